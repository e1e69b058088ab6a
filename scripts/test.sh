#!/usr/bin/env bash
# Set up and run the test suite on a fresh machine (Python 3 and pip only).
# nox and uv are installed into a private virtualenv, .venv-tools, never
# into the system interpreter; nox then builds the test environment in .nox.
# Arguments are added to pytest's: `bash scripts/test.sh -k mesh -x`.
# pytest exiting 5 (no tests collected) fails the run like any other
# failure: nox fails a session on every non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=.venv-tools
if ! "$TOOLS/bin/python" -m pip --version >/dev/null 2>&1; then
    python3 -m venv --clear "$TOOLS" || {
        echo "scripts/test.sh: 'python3 -m venv' failed; install your" \
            "distribution's venv package (e.g. python3-venv) and retry." >&2
        exit 1
    }
fi
"$TOOLS/bin/python" -m pip install --quiet --disable-pip-version-check \
    "nox>=2024.10" "uv>=0.5"
exec "$TOOLS/bin/python" -m nox -s tests -- "$@"

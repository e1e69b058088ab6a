#!/usr/bin/env bash
# Set up and run the demo on a fresh machine (Python 3 and pip only):
# a private virtualenv in .venv with the package installed (not editable, so
# its startup hook is active; never the system interpreter), then
# `keras-hub-autodist demo "$@"`, e.g. `bash scripts/demo.sh --steps 1`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    python3 -m venv --clear .venv || {
        echo "scripts/demo.sh: 'python3 -m venv' failed; install your" \
            "distribution's venv package (e.g. python3-venv) and retry." >&2
        exit 1
    }
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check .
# TensorFlow (imported by keras-hub) logs CUDA and oneDNN notices to stderr
# unless this is set before it starts.
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"
exec .venv/bin/keras-hub-autodist demo "$@"

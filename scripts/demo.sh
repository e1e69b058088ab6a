#!/usr/bin/env bash
# Set up and run the demo on a fresh machine (Python 3 and pip only):
# a virtualenv in .venv with the package installed (not editable, so its
# startup hook is active), then `keras-hub-autodist demo "$@"`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet .
exec .venv/bin/keras-hub-autodist demo "$@"

#!/usr/bin/env bash
# Set up and run the test suite on a fresh machine (Python 3 and pip only).
# pytest exiting 5 (no tests collected) fails the run like any other failure.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --upgrade "nox>=2024.10" "uv>=0.5"
python3 -m nox -s tests -- "$@"

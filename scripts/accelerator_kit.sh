#!/usr/bin/env bash
# Wheels for `python -m bench --accelerator` on a machine without network.
#
# The accelerator machine (../shared/ACCELERATOR.md) has Python 3.12, jax,
# numpy, h5py, safetensors and orbax, but not keras, keras-hub, namex or
# optree, and it can download nothing. This script puts cp312 x86-64 wheels
# of those four, and a wheel of this checkout, into .whl/ (ignored by git),
# replacing what was there. Versions default to the ones measured there and
# can be changed: `KERAS=3.15.1 KERAS_HUB=0.32.0 bash scripts/accelerator_kit.sh`.
#
# On the machine, with .whl carried along, one command installs and runs it:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile \
#       --target /tmp/site .whl/*.whl && \
#   PYTHONPATH=/tmp/site:. KERAS_BACKEND=jax PYTHONUNBUFFERED=1 \
#       python3 -m bench --accelerator --out "$OUT"
#
# `--target` installs run no `.pth` file, so the startup hook is absent
# there; bench/accelerator.py imports the package itself.
set -euo pipefail
cd "$(dirname "$0")/.."
KERAS=${KERAS:-3.15.1}
KERAS_HUB=${KERAS_HUB:-0.32.0}
NAMEX=${NAMEX:-0.1.0}
OPTREE=${OPTREE:-0.20.0}
WHEELS=.whl
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
    manylinux2014_x86_64 manylinux1_x86_64)

rm -rf "$WHEELS"
mkdir -p "$WHEELS"
python3 -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" --dest "$WHEELS" \
    "keras==$KERAS" "keras-hub==$KERAS_HUB" "namex==$NAMEX" "optree==$OPTREE"
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps \
    --wheel-dir "$WHEELS" .
ls -1 "$WHEELS"
du -sh "$WHEELS"

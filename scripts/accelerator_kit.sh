#!/usr/bin/env bash
# Wheels for `python -m bench --accelerator` on the TPU machine, which has
# no network (../shared/ACCELERATOR.md: one TPU v5e chip, Python 3.11, JAX
# with libtpu, numpy and scipy).
#
# Puts cp311 x86-64 wheels of what the bench imports beside JAX, and a wheel
# of this checkout, into .whl/ (ignored by git), replacing what was
# there. keras-hub 0.32 imports tokenizers and sentencepiece when imported;
# kagglehub is left out (without kagglesdk it fails keras-hub's import, and
# keras-hub imports fine without it). keras-hub's `fit` batches arrays with
# grain (or tensorflow, which the machine lacks): grain and what it imports
# come too, numpy aside (the machine's), and pytest for the chip's own tests
# (`scripts/accelerator_tests.sh`). Versions default to the ones tried on
# the chip: `KERAS=3.15.1 KERAS_HUB=0.32.0 bash scripts/accelerator_kit.sh`.
#
# On the machine, with .whl carried along, one command installs the kit
# into /tmp/site and runs the bench with its results under $OUT (the `run`
# tool's command; carry: [".whl"]):
#
#   bash scripts/accelerator_run.sh
#
# which is, in short:
#
#   PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q \
#       --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && \
#   PYTHONPATH=$PYTHONPATH:/tmp/site:. KERAS_BACKEND=jax \
#       python3 -m bench --accelerator --out "$OUT"
#
# `--target` installs run no `.pth` file, so the startup hook is absent
# there; the bench imports the package itself.
set -euo pipefail
cd "$(dirname "$0")/.."
KERAS=${KERAS:-3.15.1}
KERAS_HUB=${KERAS_HUB:-0.32.0}
NAMEX=${NAMEX:-0.1.0}
OPTREE=${OPTREE:-0.20.0}
WHEELS=${WHEELS:-.whl}
PYTHON_VERSION=3.11
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
# What keras and keras-hub import, at the versions above or the newest
# wheel for cp311 (pure-Python wheels match any platform).
PACKAGES=(
    "keras==$KERAS" "keras-hub==$KERAS_HUB" "namex==$NAMEX" "optree==$OPTREE"
    typing_extensions absl-py h5py packaging regex rich pygments
    markdown-it-py mdurl safetensors tokenizers sentencepiece
    grain array-record cloudpickle etils fsspec importlib_resources
    portpicker protobuf psutil zipp
    pytest pluggy iniconfig
)

rm -rf "$WHEELS"
mkdir -p "$WHEELS"
python3 -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" --dest "$WHEELS" "${PACKAGES[@]}"
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps \
    --wheel-dir "$WHEELS" .
ls -1 "$WHEELS"
du -sh "$WHEELS"

# Sourced by the TPU machine's commands (scripts/accelerator_run.sh,
# scripts/accelerator_tests.sh), from the checkout's root: install the kit
# of scripts/accelerator_kit.sh (.whl/, carried along) into $SITE, and put
# the checkout first on the path, its package rather than the kit's wheel
# of it, and the kit after the machine's own paths.
SITE=${SITE:-/tmp/site}
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index \
    --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/*.whl || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}:$SITE
export KERAS_BACKEND=jax PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3

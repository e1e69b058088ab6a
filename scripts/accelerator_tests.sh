#!/usr/bin/env bash
# The chip's own tests (`pytest -m tpu`, tests/test_on_tpu.py), run on the
# TPU machine with the kit of scripts/accelerator_kit.sh carried along (the
# `run` tool, carry [".whl"]): a load into shards, a step's loss against
# keras-hub's, splash in the program, the target compile against the
# chip's own, and the command's default answer on the steps of real shapes
# measured on the chip (eight compiles: about five of its six minutes).
# Run it whenever a device path changes. Arguments are added to pytest's;
# the quick three, about a minute: -k "not default_answer". The report
# goes to $OUT/tpu-tests.xml and $OUT/tpu-tests.txt.
#
#   bash scripts/accelerator_tests.sh [-k "not default_answer"]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tpu-tests-out}
mkdir -p "$OUT"
source scripts/accelerator_site.sh
# The chip is JAX's backend here (conftest.py defaults it to the CPU).
export JAX_PLATFORMS=tpu,cpu
timeout --signal=INT --kill-after=15 540 \
    python3 -m pytest -m tpu tests/test_on_tpu.py -p no:cacheprovider -q \
    --junitxml="$OUT/tpu-tests.xml" "$@" 2>&1 | tee "$OUT/tpu-tests.txt"
exit "${PIPESTATUS[0]}"

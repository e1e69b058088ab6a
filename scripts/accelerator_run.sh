#!/usr/bin/env bash
# The one command the TPU machine runs (the `run` tool, carry [".whl"],
# made by scripts/accelerator_kit.sh): install the kit into /tmp/site and
# run `python -m bench.accelerator` (`python -m bench --accelerator` without
# the main bench's imports), its results under $OUT
# (accelerator.json after every measurement, accelerator.md and log.txt).
#
#   bash scripts/accelerator_run.sh [more bench arguments, e.g. --parts train]
#
# Every number in two commands (docs/benchmarks.md):
#
#   bash scripts/accelerator_run.sh --parts train --models gemma_2b
#   bash scripts/accelerator_run.sh --parts train,load,attention \
#       --models gemma3_1b,llama3.2_1b
#
# The bench keeps to its parts' times (bench/accelerator_choices.py: no
# measurement starts after 450 s); `timeout` stops the whole at 9 minutes,
# inside the machine's 10, with what was measured saved. A longer part
# (`--time-scale 1.2`) may take up to the machine's limit with
# ACCELERATOR_TIMEOUT_S=575 and the `run` tool's timeout at 595.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
# The checkout's package is measured (the children put it first too).
source scripts/accelerator_site.sh
# A program compiled once is not compiled again by a later process.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
timeout --signal=INT --kill-after=15 "${ACCELERATOR_TIMEOUT_S:-540}" \
    python3 -m bench.accelerator --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
# A run stopped by `timeout` still has its results: render what was saved.
if [ "$status" != 0 ] && [ -f "$OUT/accelerator.json" ]; then
    python3 -m bench.accelerator --render "$OUT/accelerator.json" \
        --out "$OUT" > /dev/null
fi
exit "$status"

#!/usr/bin/env bash
# The layout search run on the TPU machine itself (the `run` tool, carry
# [".whl"]): with the chip attached, each compiled step that fits is timed
# on it and ranked by the chip's clock, and the rung below the fastest
# batch is timed too (docs/concepts.md, "Cost"). The three steps of
# docs/benchmarks.md, "The fastest step that fits one v5e chip", each
# answered as JSON (`--search --json`) under $OUT, with its log and time.
#
#   bash scripts/accelerator_search.sh [llama qwen gemma2]
#
# Each search stops after 170 s (`timeout`), so the three fit one command.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/search-out}
mkdir -p "$OUT"
source scripts/accelerator_site.sh
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}
export KERAS_HUB_AUTODIST_COMPILE_CACHE=${KERAS_HUB_AUTODIST_COMPILE_CACHE:-/tmp/search-cache}
PRESETS=tests/data/presets
# Llama 3.2 1B untied, as the chip trains it (tests/chip_steps.py).
LLAMA=$(python3 -c "import pathlib, sys; sys.path.insert(0, 'tests');
from chip_steps import chip_preset_folder
print(chip_preset_folder('llama3.2_1b', True, pathlib.Path('$OUT')))")
declare -A STEPS=(
    [llama]="$LLAMA 0 1024"
    [qwen]="$PRESETS/qwen2.5_0.5b 0 1024"
    [gemma2]="$PRESETS/gemma2_2b 8 2048"
)
status=0
for name in "${@:-llama qwen gemma2}"; do
    for one in $name; do
        read -r folder rank seq <<<"${STEPS[$one]}"
        lora=()
        [ "$rank" != 0 ] && lora=(--lora-rank "$rank")
        start=$(date +%s)
        timeout --signal=INT --kill-after=10 170 python3 -m keras_hub_autodist \
            plan "$folder" --device v5e --devices 1 --dtype bfloat16 \
            --per-device-batch 1:16 --seq "$seq" "${lora[@]}" --search --json \
            > "$OUT/$one.json" 2> "$OUT/$one.log"
        code=$?
        echo "$one: rc=$code in $(( $(date +%s) - start )) s" | tee -a "$OUT/times.txt"
        [ "$code" != 0 ] && status=$code
    done
done
exit "$status"

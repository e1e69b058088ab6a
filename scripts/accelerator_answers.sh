#!/usr/bin/env bash
# The command's default answer on the TPU machine, typed as a user types it:
# `plan --device v5e --batch B --seq S`, one process per step, for the steps
# of real shapes measured on the chip (tests/chip_steps.py). Where the TPU
# compiler is installed the answer is the step compiled for the chip.
# Each answer's JSON, with its step's name and the seconds it took, is a
# line of $OUT/answers.jsonl (stderr in $OUT/<name>.err where it failed).
# A process takes about a minute; arguments keep the steps whose name holds
# one of them. Run with the kit of scripts/accelerator_kit.sh carried along
# (the `run` tool, carry [".whl"]):
#
#   bash scripts/accelerator_answers.sh [gemma_2b-lora8-4x1024 llama ...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/accelerator-answers}
mkdir -p "$OUT"
source scripts/accelerator_site.sh
# One line per step: its config's folder (the untied copies in a temporary
# folder), LoRA rank (0: full), batch, sequence.
mapfile -t STEPS < <(PYTHONPATH=tests python3 - "$(mktemp -d)" <<'PY'
import pathlib, sys
from chip_steps import CHIP_STEPS, chip_preset_folder
root = pathlib.Path(sys.argv[1])
for preset, untied, rank, batch, sequence, _, _ in CHIP_STEPS:
    print(chip_preset_folder(preset, untied, root), rank or 0, batch, sequence)
PY
)
chosen() {
    [ $# -eq 1 ] && return 0
    local name=$1 word
    shift
    for word in "$@"; do [[ $name == *"$word"* ]] && return 0; done
    return 1
}
for step in "${STEPS[@]}"; do
    read -r preset rank batch seq <<<"$step"
    name="$(basename "$preset")-lora$rank-${batch}x$seq"
    chosen "$name" "$@" || continue
    lora=()
    [ "$rank" != 0 ] && lora=(--lora-rank "$rank")
    start=$(date +%s.%N)
    if answer=$(timeout 240 python3 -m keras_hub_autodist plan "$preset" \
        --mesh batch=1,model=1 --dtype bfloat16 --device v5e \
        --batch "$batch" --seq "$seq" "${lora[@]}" --json 2>"$OUT/$name.err"); then
        rm "$OUT/$name.err"
    fi
    python3 - "$name" "$start" "$(date +%s.%N)" "$answer" <<'PY' | tee -a "$OUT/answers.jsonl"
import json, sys
name, start, end, text = sys.argv[1:]
try:
    answer = json.loads(text)
except ValueError:
    answer = {"error": "no JSON answer: see the .err file"}
print(json.dumps({"step": name, "seconds": round(float(end) - float(start), 1), **answer}))
PY
done

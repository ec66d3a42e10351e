#!/usr/bin/env bash
# How strong should RL's starting model be? Builds weaker word-problem chains (wp_base cut to
# BASE steps each, then wp_sft for SFT steps) side by side and runs rl_wp from each with one
# seed, eval every 10 updates, until DEADLINE; one tarball of logs and metrics to OUT.
#   PYTHONPATH=. bash benchmarks/rl_start_sweep.sh OUT
set -uo pipefail
OUT=${1:?usage: rl_start_sweep.sh OUT}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
W=$(mktemp -d)
began=$(date +%s)
say() { echo "[$(( $(date +%s) - began )) s] $*" | tee -a "$W/steps.log"; }
chain() {  # BASE_STEPS SFT_STEPS LR TAG
  local base=outputs/wp_base_$1 sft=outputs/wp_sft_$1_$2
  if [ -n "${WAIT_FOR_BASE:-}" ]; then
    while [ ! -e "$W/base_$1.done" ]; do sleep 5; done
  elif [ ! -e "$base/hf" ]; then
    $PY -m torchloom train --recipe wp_base --training.steps "$1" --lr_schedule.warmup_steps 30 \
      --training.val_interval 0 --output.dir "$base" --output.overwrite true > "$W/base_$1.log" 2>&1 \
      || { say "base $1 failed"; return; }
  fi
  touch "$W/base_$1.done"
  say "base $1 built: $(grep -E '^done|train loss' "$W/base_$1.log" | tail -1)"
  $PY -m torchloom train --recipe wp_sft --training.steps "$2" --lr_schedule.warmup_steps 10 \
    --training.val_interval 0 --checkpoint.initial_load_hf "$base/hf" --data.tokenizer "$base/hf" \
    --output.dir "$sft" --output.overwrite true > "$W/sft_$1_$2.log" 2>&1 || { say "sft failed"; return; }
  say "sft $1/$2 built; rl $4 starts"
  timeout $(( ${DEADLINE:-560} - ($(date +%s) - began) )) $PY benchmarks/rl_gpu.py --recipe rl_wp \
    --json "$W/$4.json" -- --checkpoint.initial_load_hf "$sft/hf" --data.tokenizer "$sft/hf" \
    --optimizer.lr "$3" --eval.every 10 --output.dir "$W/$4" --output.overwrite true \
    --checkpoint.export_hf false --checkpoint.save_final_model false --metrics.tensorboard false \
    > "$W/$4.log" 2>&1
  say "rl $4 ended: $(grep -c reward_mean "$W/$4/metrics.jsonl") steps"
}
${GPU_TESTS:-true} && { timeout $(( ${DEADLINE:-560} - 20 )) $PY -m pytest -q -m gpu tests > "$W/gpu_tests.log" 2>&1; say "gpu tests: $(tail -1 "$W/gpu_tests.log")"; } &
(chain 200 60 5e-5 b200_lr5e-5) &
(chain 400 100 5e-5 b400_lr5e-5; ) &
(WAIT_FOR_BASE=1 chain 400 30 5e-5 b400_sft30) &
wait
for f in "$W"/b*/metrics.jsonl; do
  echo "== $f"; grep -o '"step": [0-9]*\|"eval_pass@[0-9]*": [0-9.]*' "$f" | paste -sd' ' | sed 's/"step"/\n step/g' | grep eval
done
tail -3 "$W/gpu_tests.log"
tar czf "$OUT/sweep.tgz" -C "$W" .
say "done"

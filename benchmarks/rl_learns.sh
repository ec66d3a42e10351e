#!/usr/bin/env bash
# The real-learning run on one GPU (docs/rl.md "It learns"): build the base model from
# generated problems with worked solutions (wp_base: pre-training, then wp_sft: chat SFT), then
# RL on held-out-evaluated word problems (rl_wp) with two seeds side by side, then a short
# lagged run for the overlap measurement. Everything it prints and each run's metrics go to OUT.
#
#   bash benchmarks/rl_learns.sh OUT [SEEDS...]        # from the repository root
#
# On the lent H200: PYTHONPATH=. and the device's python3; one call of at most 10 minutes.
set -uo pipefail
OUT=${1:?usage: rl_learns.sh OUT [SEEDS...]}
shift
SEEDS=${*:-"0 1"}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
mkdir -p "$OUT"
began=$(date +%s)
say() { echo "[$(( $(date +%s) - began )) s] $*" | tee -a "$OUT/steps.log"; }

for recipe in wp_base wp_sft; do
  if [ ! -e "outputs/$recipe/hf" ]; then
    say "train $recipe"
    $PY -m torchloom train --recipe "$recipe" --output.overwrite true > "$OUT/$recipe.log" 2>&1 \
      || { say "$recipe failed"; tail -20 "$OUT/$recipe.log"; exit 1; }
    grep -E "^done|val_loss|tok/s" "$OUT/$recipe.log" | tail -3
  fi
done

say "rl_wp seeds: $SEEDS (side by side)"
pids=()
for seed in $SEEDS; do
  $PY benchmarks/rl_gpu.py --recipe rl_wp --json "$OUT/rl_wp_seed$seed.json" -- \
    --training.seed "$seed" --output.dir "outputs/rl_wp_seed$seed" --output.overwrite true \
    > "$OUT/rl_wp_seed$seed.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || say "an RL run failed (pid $pid)"; done
for seed in $SEEDS; do
  cp "outputs/rl_wp_seed$seed/metrics.jsonl" "$OUT/metrics_seed$seed.jsonl" 2>/dev/null
  $PY -m torchloom plot "outputs/rl_wp_seed$seed" --metric eval_pass@1 --metric reward_mean \
    && cp outputs/rl_wp_seed$seed/metrics-eval_pass_1-reward_mean.png "$OUT/eval_seed$seed.png"
  tail -12 "$OUT/rl_wp_seed$seed.log"
done
say "rl_wp done"

if [ -n "${LAGGED_STEPS:-}" ]; then
  say "lagged colocated: $LAGGED_STEPS steps with max_offpolicy_steps 1, then on-policy"
  for lag in 1 0; do
    $PY benchmarks/rl_gpu.py --recipe rl_wp --json "$OUT/lag$lag.json" -- \
      --training.steps "$LAGGED_STEPS" --rl.max_offpolicy_steps $lag --eval.every 0 --eval.k 0 \
      --output.dir "outputs/rl_wp_lag$lag" --output.overwrite true > "$OUT/lag$lag.log" 2>&1
    tail -8 "$OUT/lag$lag.log"
  done
fi
say "all done"

#!/usr/bin/env bash
# The real-learning run on one GPU (docs/rl.md "It learns"): build the base model from
# generated problems with worked solutions (wp_base: pre-training, then wp_sft: chat SFT), then
# RL on held-out-evaluated word problems (rl_wp) with two seeds side by side, then a short
# lagged run for the overlap measurement. Everything it prints and each run's metrics go to OUT.
#
#   bash benchmarks/rl_learns.sh OUT [SEEDS...]        # from the repository root
#
# On the lent H200: PYTHONPATH=. and the device's python3; one call of at most 10 minutes.
# DEADLINE (seconds from the start, default 570) stops the RL runs in time for the call's
# limit; each run's metrics.jsonl is written as it goes, into OUT/seedN/, so a stopped run's
# curve still comes back.
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

left=$(( ${DEADLINE:-570} - ($(date +%s) - began) ))
say "rl_wp seeds: $SEEDS (side by side), ${left} s left"
pids=()
for seed in $SEEDS; do
  timeout "$left" $PY benchmarks/rl_gpu.py --recipe rl_wp --json "$OUT/rl_wp_seed$seed.json" \
    -- --training.seed "$seed" --output.dir "$OUT/seed$seed" --output.overwrite true \
    --checkpoint.export_hf false --checkpoint.save_final_model false --metrics.tensorboard false \
    ${RL_ARGS:-} > "$OUT/rl_wp_seed$seed.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || say "an RL run ended early (pid $pid)"; done
for seed in $SEEDS; do
  $PY -m torchloom plot "$OUT/seed$seed" --metric eval_pass@1 --metric reward_mean
  tail -14 "$OUT/rl_wp_seed$seed.log"
done
say "rl_wp done"

if [ -n "${LAGGED_STEPS:-}" ]; then
  say "lagged colocated: $LAGGED_STEPS steps with max_offpolicy_steps 1, then on-policy"
  for lag in 1 0; do
    $PY benchmarks/rl_gpu.py --recipe rl_wp --json "$OUT/lag$lag.json" -- \
      --training.steps "$LAGGED_STEPS" --rl.max_offpolicy_steps $lag --eval.every 0 --eval.k 0 \
      --output.dir "outputs/rl_wp_lag$lag" --output.overwrite true --checkpoint.export_hf false \
      --checkpoint.save_final_model false > "$OUT/lag$lag.log" 2>&1
    tail -8 "$OUT/lag$lag.log"
  done
fi
say "all done"

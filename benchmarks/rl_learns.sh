#!/usr/bin/env bash
# The real-learning run on one GPU (docs/rl.md "It learns"): build the base model from
# generated problems with worked solutions (wp_base: pre-training, then wp_sft: chat SFT on a
# mix of worked and direct answers), then RL on word problems (rl_wp) with the seeds side by
# side, each evaluated on the 500 held-out problems. With LAGGED=1 a third run beside them is
# the lagged colocated placement (--rl.max_offpolicy_steps 1) from seed 0, for the step-time
# overlap. Everything goes to one tarball, OUT/rl_learns.tgz (the device returns 8 files).
#
#   bash benchmarks/rl_learns.sh OUT [SEEDS...]        # from the repository root
#
# On the lent H200: PYTHONPATH=. and the device's python3; one call of at most 10 minutes.
# DEADLINE (seconds from the start, default 570) stops the RL runs in time for the call's
# limit; RL_ARGS are added to every RL run's command line; EXTRA runs beside everything (a
# command, e.g. the GPU tests), its output in extra.log; BEFORE runs beside the base model's
# training only and is waited for before the RL runs start, so they are timed alone (its output
# in before.log).
set -uo pipefail
OUT=${1:?usage: rl_learns.sh OUT [SEEDS...]}
shift
SEEDS=${*:-"0 1"}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
mkdir -p "$OUT"
W=$(mktemp -d)
began=$(date +%s)
say() { echo "[$(( $(date +%s) - began )) s] $*" | tee -a "$W/steps.log"; }
pack() { tar czf "$OUT/rl_learns.tgz" -C "$W" . ; }
trap pack EXIT
[ -n "${EXTRA:-}" ] && { bash -c "$EXTRA" > "$W/extra.log" 2>&1; say "extra: $(tail -1 "$W/extra.log")"; } &
before_pid=
if [ -n "${BEFORE:-}" ]; then
  { bash -c "$BEFORE" > "$W/before.log" 2>&1; say "before: $(tail -1 "$W/before.log")"; } &
  before_pid=$!
fi

for recipe in wp_base wp_sft; do
  if [ ! -e "outputs/$recipe/hf" ]; then
    say "train $recipe"
    $PY -m torchloom train --recipe "$recipe" --output.overwrite true > "$W/$recipe.log" 2>&1 \
      || { say "$recipe failed"; tail -20 "$W/$recipe.log"; exit 1; }
    grep -E "^done" "$W/$recipe.log" | tail -1
  fi
done

[ -n "$before_pid" ] && wait "$before_pid"
left=$(( ${DEADLINE:-570} - ($(date +%s) - began) ))
runs=()
for seed in $SEEDS; do runs+=("seed$seed:$seed:0"); done
[ -n "${LAGGED:-}" ] && runs+=("lag1:0:1")
say "rl_wp runs: ${runs[*]} (side by side), ${left} s left"
pids=()
for run in "${runs[@]}"; do
  IFS=: read -r name seed lag <<< "$run"
  timeout "$left" $PY benchmarks/rl_gpu.py --recipe rl_wp --json "$W/$name.json" \
    -- --training.seed "$seed" --rl.max_offpolicy_steps "$lag" --output.dir "$W/$name" \
    --output.overwrite true --checkpoint.export_hf false --checkpoint.save_final_model false \
    --metrics.tensorboard false ${RL_ARGS:-} > "$W/$name.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || say "an RL run ended early (pid $pid)"; done
for run in "${runs[@]}"; do
  name=${run%%:*}
  echo "== $name"
  grep -E "^step .*eval_" "$W/$name.log"
  tail -16 "$W/$name.log" | grep -v "^step "
  $PY -m torchloom plot "$W/$name" --metric eval_pass@1 --metric reward_mean > /dev/null
done
wait
say "all done"

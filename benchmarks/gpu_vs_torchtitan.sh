#!/usr/bin/env bash
# Issue 35's speed rows side by side with TorchTitan 0.2.2: llama3 1B, 8B bf16, 8B float8
# tensorwise and DeepSeek-V3 16B cut to 6 layers, each through benchmarks/vs_torchtitan.py (a
# table and JSON per row under LOG_DIR). All four take about 13 minutes on an H200: run them as
# two device calls (`... LOG 1B 8B`, then `... LOG 8B-fp8 moe`), each under the 10-minute limit.
#
# TorchTitan and its requirements are not dependencies and the device has no network: download
# the wheels here first into .whl/ (ignored by git; carry it to the device):
#   python -m pip download --no-deps -d .whl torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 \
#       datasets==5.2.0 torchao==0.18.0
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux_2_28_x86_64 -d .whl docstring-parser typeguard tomli einops \
#       "dill<0.4.2" xxhash "multiprocess<0.70.20" tensorboard tensorboard-data-server absl-py \
#       markdown werkzeug grpcio protobuf
# Usage: bash benchmarks/gpu_vs_torchtitan.sh [LOG_DIR] [ROW...]   (rows: 1B 8B 8B-fp8 moe, and
# torchloom alone in other settings, against the TorchTitan figure of its base row in the same
# call: 8B-castsK (--remat.weight_casts recompute, every K-th block recomputed:
# benchmarks/block_memory.py estimates each K's activations), 8B-fp8-everyK (float8 tensorwise,
# every K-th block recomputed: float8 keeps no weight copies, so the headroom under TorchTitan's
# float8 memory goes to recomputing fewer blocks), 8B-budgetB (--remat.mode budget with memory
# budget B, e.g. 8B-budget0.5: the compiler picks what each block recomputes; 8B-fp8-budgetB
# with float8), 1B-fa4 / 8B-fa4 (FlashAttention 4, after `bash benchmarks/fa4_wheels.sh
# install`), 8B-fp8-fa4-budgetB[-capG][-g16][-casts] (float8, FlashAttention 4, budget B; -capG
# caps the allocator at G GiB (--training.memory_limit_gib), -g16 holds the linear weights'
# gradients in bf16 (--optimizer.grad_dtype bf16), -casts recomputes the weights' casts
# (--remat.weight_casts recompute); e.g. 8B-fp8-fa4-budget0.9-g16))
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-outputs/vs_torchtitan}
shift || true
ROWS=${*:-1B 8B 8B-fp8 moe}
mkdir -p "$LOG"
export PYTHONPATH=. PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .whl torchtitan==0.2.2 torchdata tyro datasets \
  torchao==0.18.0 2>&1 | tail -n 3
python3 -c "import torchtitan.train" || { echo "TorchTitan is not importable: see the header"; exit 1; }

row() {  # name, timeout, vs_torchtitan.py arguments
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $name"
  timeout "$limit" python3 benchmarks/vs_torchtitan.py --workdir "/tmp/vs_torchtitan_$name" \
    --json "$LOG/$name.json" "$@" > "$LOG/$name.log" 2>&1
  tail -n 5 "$LOG/$name.log"
  cp "/tmp/vs_torchtitan_$name/torchtitan.log" "$LOG/${name}_torchtitan.log" 2>/dev/null
  cp "/tmp/vs_torchtitan_$name/torchloom.log" "$LOG/${name}_torchloom.log" 2>/dev/null
  echo "   ($((SECONDS - start)) s)"
}
for r in $ROWS; do
  case $r in
    1B) row 1B 170 --flavor 1B --batch 8 --steps 40 --timeout 80 ;;
    8B) row 8B 190 --flavor 8B --batch 2 --recompute every_2nd --steps 20 --timeout 90 ;;
    8B-fp8) row 8B-fp8 190 --flavor 8B --batch 2 --recompute every_2nd --float8 --steps 20 --timeout 90 ;;
    8B-fp8-tt)  # TorchTitan's float8 row alone (its every-2nd-block default), for the rows below
      row 8B-fp8-tt 110 --sides torchtitan --flavor 8B --batch 2 --recompute every_2nd --float8 \
        --steps 20 --timeout 100 ;;
    moe) row moe 250 --model deepseek_v3 --batch 4 --steps 30 --timeout 120 ;;
    8B-casts[0-9]*)  # every K-th block recomputed, K from the row's name
      row "$r" 110 --sides torchloom --flavor 8B --batch 2 --recompute every_2nd --steps 20 \
        --timeout 100 --torchloom-args "--remat.weight_casts recompute --remat.every_k ${r#8B-casts}" ;;
    8B-fp8-every[0-9]*)  # float8, every K-th block recomputed, K from the row's name
      row "$r" 110 --sides torchloom --flavor 8B --batch 2 --recompute every_2nd --float8 --steps 20 \
        --timeout 100 --torchloom-args "--remat.every_k ${r#8B-fp8-every}" ;;
    8B-budget[0-9.]*)  # the compiler's min-cut partitioner picks what to recompute, per block
      row "$r" 110 --sides torchloom --flavor 8B --batch 2 --steps 20 --timeout 100 \
        --torchloom-args "--remat.mode budget --remat.memory_budget ${r#8B-budget}" ;;
    8B-fp8-budget[0-9.]*)  # the same with float8 tensorwise
      row "$r" 110 --sides torchloom --flavor 8B --batch 2 --steps 20 --timeout 100 --float8 \
        --torchloom-args "--remat.mode budget --remat.memory_budget ${r#8B-fp8-budget}" ;;
    8B-fp8-fa4-budget[0-9.]*)  # float8 + FlashAttention 4 + budget B [+ suffixes, below]
      IFS=- read -ra parts <<< "${r#8B-fp8-fa4-budget}"
      extra="--remat.mode budget --remat.memory_budget ${parts[0]}"
      for s in "${parts[@]:1}"; do
        case $s in
          cap*) extra+=" --training.memory_limit_gib ${s#cap}" ;;  # allocator capped at G GiB
          g16) extra+=" --optimizer.grad_dtype bf16" ;;  # linear weights' gradients in bf16
          casts) extra+=" --remat.weight_casts recompute" ;;
          *) echo "unknown suffix $s of $r (capG, g16, casts)"; continue 2 ;;
        esac
      done
      row "$r" 110 --sides torchloom --flavor 8B --batch 2 --steps 20 --timeout 100 --float8 --fa4 \
        --torchloom-args "$extra" ;;
    1B-fa4) row 1B-fa4 100 --sides torchloom --flavor 1B --batch 8 --steps 40 --timeout 90 --fa4 ;;
    8B-fa4) row 8B-fa4 110 --sides torchloom --flavor 8B --batch 2 --recompute every_2nd --steps 20 \
      --timeout 100 --fa4 ;;
    *) echo "unknown row $r (1B 8B 8B-fp8 8B-fp8-tt moe 8B-castsK 8B-fp8-everyK 8B-budgetB 8B-fp8-budgetB 1B-fa4 8B-fa4 8B-fp8-fa4-budgetB[-capG][-g16][-casts])" ;;
  esac
done

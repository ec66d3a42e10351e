#!/usr/bin/env bash
# The hybrid linear-attention GPU checks of issue 22 (benchmarks/RESULTS.md), as named steps,
# each with its own time limit; each step's whole log goes to OUT_DIR/<step>.log, its tail to
# stdout. fla's first calls autotune its Triton kernels: minutes per process, so on a fresh
# machine a step takes far longer than its timed part (2026-12-03: a call running only the
# `layers` benchmark took 263 s; `models_4k` did not finish in 150 s). On the lent device (10
# minutes a call) pick steps per call so their limits add up to less; no step given means speed.
#   models       the 3:1 hybrid vs full attention at 32k, with kernel tables (target 1.5x)
#   models_4k    the same at 4k
#   layers       one Gated DeltaNet layer vs transformers' with fla on both sides (target 1.3x)
#   fla_backend  fla's whole gated delta rule with each form of the dqkwg step vs the chunked
#                form (outputs, gradients), then the step alone (torchloom's Triton kernel at 4
#                and 8 warps, its PyTorch form, fla's kernel): error and time
#   invariant    batch-invariant mode of the hybrids, Kimi Linear and DeepSeek-V3 on CUDA, and
#                MoE decode with and without CUDA graphs (pytest -m gpu)
#   train        `torchloom train --compile.enabled true` of qwen3_5_debug on CUDA with fla
#   gradients    fla's kernels vs the chunked form with gradients (pytest -m gpu), through
#                torchloom's fla backend where fla refuses its own kernel
# Groups (each more than one call's worth on a fresh machine): speed = models layers
#   models_4k; checks = fla_backend invariant train gradients.
# Before a call (here): pip download fla-core einops pytest pluggy iniconfig packaging pygments
#   --no-deps --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: -d .whl
#   (carry .whl, git-ignored).
# Usage (repository root, on the device): bash benchmarks/gpu_hybrid.sh OUT_DIR STEP|GROUP...
set -uo pipefail
OUT=${1:-outputs/gpu_hybrid}
shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
# The interpreter that runs the code installs the wheels (a bare `pip` may be another one's).
python3 -m pip install --no-index --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -n 1
python3 -c "import fla, torch, triton; print('fla', fla.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "from torchloom.kernels.delta_rule import fla_backward_safe; print('fla backward safe here:', fla_backward_safe())"
step() {  # step NAME LIMIT_S TAIL_LINES COMMAND...
  local name=$1 limit=$2 lines=$3; shift 3; local start=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -vi "warn" "$OUT/$name.log" | tail -n "$lines"
  echo "== $name: exit $rc, $((SECONDS - start)) s"
}
bench=(python3 benchmarks/hybrid.py)
gpu_tests=(python3 -m pytest -q -p no:cacheprovider -m gpu -s)
for name in "${@:-speed}"; do
  case $name in
    speed) set -- models layers models_4k ;;
    checks) set -- fla_backend invariant train gradients ;;
    *) set -- "$name" ;;
  esac
  for s in "$@"; do
    case $s in
      models) step models 230 45 "${bench[@]}" --rows hybrid full --seq-lens 32768 --steps 3 --warmup 2 --profile-steps 1 --json "$OUT/hybrid_models.json" ;;
      models_4k) step models_4k 280 12 "${bench[@]}" --rows hybrid full --seq-lens 4096 --steps 3 --warmup 2 --json "$OUT/hybrid_models_4k.json" ;;
      layers) step layers 420 12 "${bench[@]}" --rows layer-compiled hf-layer --seq-lens 4096 --steps 4 --warmup 3 --json "$OUT/hybrid_layers.json" ;;
      fla_backend) step fla_backend 240 24 python3 benchmarks/fla_backend.py --gradients --json "$OUT/fla_backend.json" ;;
      invariant) step invariant 100 12 "${gpu_tests[@]}" tests/generate/test_batch_invariant.py tests/generate/test_engine.py -k "recurrent or moe" ;;
      train) step train 220 8 python3 -m torchloom train --recipe qwen3_5_debug --training.device cuda --training.steps 6 --compile.enabled true --training.sample_tokens 0 --metrics.tensorboard false --checkpoint.save_final_model false --output.dir "$OUT/train" --output.overwrite true ;;
      gradients) step gradients 400 20 "${gpu_tests[@]}" tests/kernels/test_delta_rule.py ;;
      *) echo "unknown step $s: see the header of $0"; exit 2 ;;
    esac
  done
done

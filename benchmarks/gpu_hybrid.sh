#!/usr/bin/env bash
# The hybrid linear-attention GPU checks of issue 22 (benchmarks/RESULTS.md) in two calls of
# under 10 minutes; each step's whole log goes to OUT_DIR/<step>.log, its tail to stdout.
# speed (first call):
#   1. the 3:1 hybrid vs full attention at 32k, with kernel tables (target 1.5x), then at 4k
#   2. one Gated DeltaNet layer vs transformers' with fla on both sides (target 1.3x)
# checks (second call):
#   3. torchloom's fla backend step (PyTorch, and its staged Triton kernel) vs fla's (error, time)
#   4. fla's kernels vs the chunked form with gradients (pytest -m gpu), through torchloom's
#      fla backend where fla refuses its own kernel
#   5. `torchloom train --compile.enabled true` of qwen3_5_debug on CUDA with fla
#   6. batch-invariant mode of the hybrids, Kimi Linear and DeepSeek-V3 on CUDA (pytest -m gpu)
# Before a call (here): pip download fla-core einops pytest pluggy iniconfig packaging pygments
#   --no-deps --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: -d .whl
#   (carry .whl, git-ignored). fla's first calls autotune its Triton kernels: minutes.
# Usage (repository root, on the device): bash benchmarks/gpu_hybrid.sh OUT_DIR speed|checks
set -uo pipefail
OUT=${1:-outputs/gpu_hybrid}
PART=${2:-speed}
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
if [ "$PART" = speed ]; then
  step models 230 45 python3 benchmarks/hybrid.py --rows hybrid full --seq-lens 32768 --steps 3 --warmup 2 --profile-steps 1 --json "$OUT/hybrid_models.json"
  step layers 170 12 python3 benchmarks/hybrid.py --rows layer-compiled hf-layer hf-layer-compiled --seq-lens 4096 --steps 4 --warmup 3 --json "$OUT/hybrid_layers.json"
  step models_4k 150 12 python3 benchmarks/hybrid.py --rows hybrid full --seq-lens 4096 --steps 3 --warmup 2 --json "$OUT/hybrid_models_4k.json"
else
  step fla_backend 150 10 python3 benchmarks/fla_backend.py --json "$OUT/fla_backend.json"
  step gpu_tests 200 20 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_delta_rule.py -s
  step train 120 6 python3 -m torchloom train --recipe qwen3_5_debug --training.device cuda --training.steps 6 --compile.enabled true --training.sample_tokens 0 --metrics.tensorboard false --checkpoint.save_final_model false --output.dir "$OUT/train" --output.overwrite true
  step invariant 90 12 python3 -m pytest -q -p no:cacheprovider -m gpu tests/generate/test_batch_invariant.py -k recurrent -s
fi

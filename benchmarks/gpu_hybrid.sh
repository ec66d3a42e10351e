#!/usr/bin/env bash
# The hybrid linear-attention GPU checks of issue 22 in one call (benchmarks/RESULTS.md, ninth
# session): fla-core carried as wheels, its kernels against the chunked form, a compiled
# training run, kernel tables of one Gated DeltaNet layer, and the 3:1 hybrid vs full attention.
# Before the call (here): pip download fla-core einops --no-deps --python-version 3.12
#   --platform manylinux2014_x86_64 --only-binary=:all: -d .whl   (carry .whl, git-ignored)
# Usage (repository root, on the device): bash benchmarks/gpu_hybrid.sh OUT_DIR [--fla-unchecked]
# --fla-unchecked times fla's backward where fla refuses it (Hopper, Triton < 3.7.1, no
# tilelang): speed only, its gradients may be wrong there.
set -uo pipefail
OUT=${1:-outputs/gpu_hybrid}
UNCHECKED=${2:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
# The interpreter that runs the code installs the wheels (a bare `pip` may be another one's).
python3 -m pip install --no-index --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -n 1
python3 -c "import fla, torch, triton; print('fla', fla.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "from torchloom.kernels.delta_rule import fla_backward_safe; print('fla backward safe here:', fla_backward_safe())"
run() { local limit=$1; shift; local start=$SECONDS; echo "== $*"; timeout "$limit" "$@"; echo "   (exit $?, $((SECONDS - start)) s)"; }
run 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_delta_rule.py -s 2>&1 | grep -E "fla vs|passed|failed|rror" | tail -n 16
run 120 python3 -m torchloom train --recipe qwen3_5_debug --training.device cuda --training.steps 6 --compile.enabled true --training.sample_tokens 0 --metrics.tensorboard false --checkpoint.save_final_model false --output.dir "$OUT/train" --output.overwrite true 2>&1 | grep -E "done:|rror" | tail -n 4
run 200 python3 benchmarks/hybrid.py $UNCHECKED --rows layer-compiled hf-layer --seq-lens 32768 --steps 4 --warmup 3 --profile-steps 1 --json "$OUT/hybrid_layers.json" 2>&1 | grep -vi warn | tail -n 40
run 300 python3 benchmarks/hybrid.py $UNCHECKED --rows hybrid full --steps 3 --warmup 2 --json "$OUT/hybrid_models.json" 2>&1 | grep -vi warn | tail -n 8

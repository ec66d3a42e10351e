#!/usr/bin/env bash
# The hybrid linear-attention GPU checks of issue 22 in one call (benchmarks/RESULTS.md):
# fla-core carried as wheels; torchloom's fla backend against fla's Triton kernel; fla's kernels
# against the chunked form (pytest -m gpu); the 3:1 hybrid vs full attention at 32k with kernel
# tables; one Gated DeltaNet layer against transformers' with fla on both sides.
# Before the call (here): pip download fla-core einops pytest pluggy iniconfig packaging pygments
#   --no-deps --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: -d .whl
#   (carry .whl, git-ignored)
# Usage (repository root, on the device): bash benchmarks/gpu_hybrid.sh OUT_DIR
set -uo pipefail
OUT=${1:-outputs/gpu_hybrid}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
# The interpreter that runs the code installs the wheels (a bare `pip` may be another one's).
python3 -m pip install --no-index --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -n 1
python3 -c "import fla, torch, triton; print('fla', fla.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "from torchloom.kernels.delta_rule import fla_backward_safe; print('fla backward safe here:', fla_backward_safe())"
run() { local limit=$1; shift; local start=$SECONDS; echo "== $*"; timeout "$limit" "$@"; echo "   (exit $?, $((SECONDS - start)) s)"; }
run 100 python3 benchmarks/fla_backend.py --json "$OUT/fla_backend.json" 2>&1 | grep -vi warn | tail -n 12
run 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_delta_rule.py -s 2>&1 | grep -E "fla vs|passed|failed|rror|==" | tail -n 20
run 210 python3 benchmarks/hybrid.py --rows hybrid full --seq-lens 32768 --steps 3 --warmup 2 --profile-steps 1 --json "$OUT/hybrid_models.json" 2>&1 | grep -vi warn | tail -n 50
run 140 python3 benchmarks/hybrid.py --rows layer-compiled hf-layer --seq-lens 4096 --steps 4 --warmup 3 --profile-steps 1 --json "$OUT/hybrid_layers.json" 2>&1 | grep -vi warn | tail -n 45

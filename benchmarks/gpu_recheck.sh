#!/usr/bin/env bash
# The GPU numbers a core change must keep (benchmarks/RESULTS.md): the training step at the 1B
# and 8B shapes, generation at batch 1/8/64, then the GPU-marked tests of the trainer.
# Usage (repository root): bash benchmarks/gpu_recheck.sh OUT_DIR
set -uo pipefail
OUT=${1:-outputs/gpu_recheck}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
run() { local limit=$1; shift; local start=$SECONDS; echo "== $*"; timeout "$limit" "$@"; echo "   (exit $?, $((SECONDS - start)) s)"; }
run 170 python3 benchmarks/train.py --shapes 1B --batch 8 --rows torchloom-chunked --steps 5 --warmup 3 --optimizer triton --json "$OUT/train_1b.json" 2>&1 | grep -v "^ *step" | tail -n 12
run 200 python3 benchmarks/train.py --shapes 8B --batch 4 --rows torchloom-chunked --steps 4 --warmup 2 --optimizer triton --json "$OUT/train_8b.json" 2>&1 | tail -n 12
run 130 python3 benchmarks/generate.py --rows ours ours-bi --batches 1 8 64 --train-seq 0 --json "$OUT/generate.json" 2>&1 | tail -n 14
run 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/train/test_cuda_graph.py 2>&1 | tail -n 6

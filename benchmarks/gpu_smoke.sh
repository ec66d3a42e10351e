#!/usr/bin/env bash
# One GPU smoke run (what benchmarks/RESULTS.md records): the README's main job on the GPU,
# SFT from its export, the CPU test suite on the machine's torch, the GPU-marked tests, and a
# short llama3 1B-shaped training run (eager, bf16 autocast, one GPU) for throughput and MFU.
# Usage: bash benchmarks/gpu_smoke.sh [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-outputs/gpu_smoke}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 PIP_RETRIES=0 PIP_TIMEOUT=5
nvidia-smi -L | tee "$LOG/device.txt"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" | tee -a "$LOG/device.txt"

step() { echo "== $1"; shift; local start=$SECONDS; "$@"; echo "   ($((SECONDS - start)) s)"; }
quiet() { grep -vE "^step +[0-9]+/[0-9]+ " | tail -n "$1"; }

step "make train" make train 2>&1 | tee "$LOG/make_train.log" | quiet 12
step "sft_tiny" .venv/bin/torchloom train --recipe sft_tiny --output.overwrite true 2>&1 \
  | tee "$LOG/sft.log" | quiet 8
step "llama3 1B-shaped, seq 2048, 8 x 2048 tokens/step" .venv/bin/torchloom train --recipe debug \
  --model.flavor 1B --training.seq_len 2048 --training.global_batch_size 8 \
  --training.steps 12 --lr_schedule.warmup_steps 2 --data.document_mask false \
  --optimizer.lr 3e-4 --training.sample_tokens 0 --checkpoint.save_final_model false \
  --output.dir outputs/smoke_1b --output.overwrite true 2>&1 | tee "$LOG/llama3_1b.log" | tail -n 6
step "pytest -m gpu" .venv/bin/python -m pytest -q -m gpu -p no:cacheprovider 2>&1 \
  | tee "$LOG/pytest_gpu.log" | tail -n 6
step "pytest (CPU only)" env CUDA_VISIBLE_DEVICES= .venv/bin/python -m pytest -q -x \
  -p no:cacheprovider 2>&1 | tee "$LOG/pytest_cpu.log" | tail -n 8

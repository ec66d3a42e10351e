#!/usr/bin/env bash
# The decode-side changes on a GPU, in one call (issue 35's batch-1 goal): the GPU tests of the
# generator's Triton kernels (decode attention, log-softmax + argmax) and of the generator, then
# the 1B bf16 decode step with and without the kernels (benchmarks/decode_step.py), then
# `generate` tokens/s of the compiled generator at batch 1 / 8 / 64 with the kernels off
# (torch) and on (auto: the two decode kernels, and the one-launch step at one row), and at
# batch 64 over a 4096-token cache (where the masked matmul softmax reads every cached index
# for every row). Beyond the default parts: `pdl` (the step
# also compiled with programmatic dependent launch, with and without the kernels) and `probe`
# (the one-row matmuls through each cuBLAS entry point, and the persistent-kernel chain probe:
# benchmarks/one_row_matmul.py, benchmarks/persistent_decode.py) and `fused` (the one-launch
# step's GPU test, then its replay and tokens/s against the compiled forward: the default
# (one task a program a stage, dealt round-robin, the down projection's partials summed by
# their readers, each head strip combining its blocks' (max, sum, argmax) before the last task
# combines them all), then with the last task combining every block's (the combine before s47:
# ...x1x0x1x1x1x0), two waves (the default before s46), the attention's stages at one wave
# with the MLP's at two (small_waves 1: 8192x4x2x2x3x1x0x1x1x1), and the defaults before s43
# (two waves, tasks from the counter, the partials summed by the last chunk: x1x0x0x0))
# and `strip` (the fused step's inner loop alone, benchmarks/strip_loop.py: whole rows summed
# every iteration against row segments summed once a row block, then tasks of 1-16 row blocks,
# bare, as the fused step runs them (the wait before the loop and inside it), with the wait or
# the publishing alone, and as one stream a program, in TB/s beside torch.mv and F.linear).
# And `trace` (benchmarks/fused_trace.py: where the fused step's time goes inside its launch,
# from each task's clock stamps: the default, and with the combine before s47; the raw stamps kept under
# OUT_DIR/stamps).
# Usage (repository root): bash benchmarks/gpu_decode.sh OUT_DIR [tests|step|generate|long|pdl|probe|fused|trace|strip ...]
set -uo pipefail
OUT=${1:-outputs/gpu_decode}
shift || true
PARTS=${*:-tests step generate long}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
run() { local limit=$1; shift; local start=$SECONDS; echo "== $*"; timeout "$limit" "$@"; echo "   (exit $?, $((SECONDS - start)) s)"; }
for part in $PARTS; do
  case $part in
    tests)
      run 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/kernels/test_decode_attention.py \
        tests/kernels/test_log_softmax.py tests/generate/test_engine.py tests/train/test_grad_dtype.py 2>&1 | tail -n 25 ;;
    step)
      run 240 python3 benchmarks/decode_step.py --kernels --json "$OUT/decode_step.json" 2>&1 | tail -n 6 ;;
    generate)
      for kernels in torch auto; do
        run 300 python3 benchmarks/generate.py --rows ours-compiled --batches 1 8 64 --train-seq 0 \
          --decode-attention "$kernels" --score-kernel "$kernels" --step-kernel "$kernels" \
          --json "$OUT/generate_$kernels.json" 2>&1 | tail -n 6
      done ;;
    long)
      for kernels in torch auto; do
        run 200 python3 benchmarks/generate.py --rows ours-compiled --batches 64 --train-seq 0 \
          --max-len 4096 --decode-attention "$kernels" --score-kernel "$kernels" --json "$OUT/generate_long_$kernels.json" 2>&1 | tail -n 4
      done ;;
    pdl)
      run 300 python3 benchmarks/decode_step.py --kernels --pdl --json "$OUT/decode_step_pdl.json" 2>&1 | tail -n 8 ;;
    probe)
      run 90 python3 benchmarks/persistent_decode.py --json "$OUT/persistent_decode.json" 2>&1 | tail -n 12
      run 60 python3 benchmarks/one_row_matmul.py --json "$OUT/one_row_matmul.json" 2>&1 | tail -n 8 ;;
    fused)
      run 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/kernels/test_fused_decode.py 2>&1 | tail -n 4
      run 300 python3 benchmarks/decode_step.py --fused-only --fused 8192x4x2x1x3 \
        8192x4x2x1x3x1x0x1x1x1x0 8192x4x2x2x3 8192x4x2x2x3x1x0x1x1x1 8192x4x2x2x3x1x0x0x0 \
        --json "$OUT/decode_step_fused.json" 2>&1 | grep -E "compiled|fused" ;;
    trace)
      run 150 python3 benchmarks/fused_trace.py --fused 8192x4x2x1x3 8192x4x2x1x3x1x0x1x1x1x0 \
        --stamps "$OUT/stamps" --json "$OUT/fused_trace.json" 2>&1 | tail -n 14 ;;
    strip)
      run 200 python3 benchmarks/strip_loop.py --json "$OUT/strip_loop.json" 2>&1 | tail -n 10 ;;
    *) echo "unknown part $part (tests, step, generate, long, pdl, probe, fused, trace, strip)"; exit 2 ;;
  esac
done

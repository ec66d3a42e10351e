#!/usr/bin/env bash
# FlashAttention 4 (flash-attn-4, CuTe DSL) for the lent H200, which has no network and takes at
# most 64 MiB of carried files a call. Its CUDA 13 library wheel alone is 92 MB, so it travels in
# two parts on two back-to-back calls to one warm machine (benchmarks/RESULTS.md, twenty-third
# session):
#   bash benchmarks/fa4_wheels.sh download       # here: wheels into .big2/, part 1 into .big/
#   run(carry=[".big"]):  any work (part 1 stays on the machine: .big/ is git-ignored)
#   run(carry=[".big2"]): bash benchmarks/fa4_wheels.sh install && python3 benchmarks/attention.py --rows sdpa-cudnn fa4
# The two calls must land on the same machine (it is released 30 s after a call).
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
  download)
    mkdir -p .big .big2 /tmp/fa4_libs
    PIP=(python -m pip download --no-deps --only-binary=:all: --python-version 3.12
         --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
         --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    "${PIP[@]}" -d .big2 flash-attn-4==4.0.0b40 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 \
      nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
      "apache-tvm-ffi<0.2" torch-c-dlpack-ext einops cuda-bindings cuda-pathfinder
    "${PIP[@]}" -d /tmp/fa4_libs nvidia-cutlass-dsl-libs-cu13==4.8.1
    rm -rf /tmp/fa4_libs/x && mkdir /tmp/fa4_libs/x
    (cd /tmp/fa4_libs/x && unzip -q ../nvidia_cutlass_dsl_libs_cu13-*.whl && tar cf - . | xz -T2 -9e > ../cu13.tar.xz)
    split -b 40000000 /tmp/fa4_libs/cu13.tar.xz /tmp/fa4_libs/cu13.part.
    mv /tmp/fa4_libs/cu13.part.aa .big/ && mv /tmp/fa4_libs/cu13.part.ab .big2/
    du -sh .big .big2 ;;
  install)
    site=$(python3 -c "import site; print(site.getsitepackages()[0])")
    [ -f .big/cu13.part.aa ] || { echo "part 1 (.big/) is not on this machine: carry it first"; exit 1; }
    cat .big/cu13.part.aa .big2/cu13.part.ab | tar -xJ -C "$site"
    python3 -m pip install -q --no-index --find-links .big2 --no-deps flash-attn-4 quack-kernels \
      nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core apache-tvm-ffi \
      torch-c-dlpack-ext einops
    python3 -c "import cuda.bindings" 2>/dev/null || python3 -m pip install -q --no-index \
      --find-links .big2 --no-deps cuda-bindings cuda-pathfinder
    python3 -c "import flash_attn.cute; print('flash-attn-4 imports')" ;;
  *) echo "usage: bash benchmarks/fa4_wheels.sh download|install"; exit 2 ;;
esac

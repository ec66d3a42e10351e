#!/usr/bin/env bash
# Sets up what is missing: a virtual environment in .venv with PyTorch and torchloom (+ test tools).
# PyTorch: the one already installed on this machine when there is one; else a CPU build on a
# machine without an NVIDIA GPU, a CUDA build where there is one. Safe to run again: it only adds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  if "$PY" -c "import torch" 2>/dev/null; then
    # Reuse that PyTorch (and the packages beside it) through a .pth file: unlike
    # --system-site-packages this also works when $PY itself lives in a virtual environment.
    host_site=$("$PY" -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
    venv_site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$host_site" > "$venv_site/_torchloom_host_packages.pth"
    echo "setup: reusing the PyTorch installed in $host_site"
  fi
fi
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: installing a CUDA build of PyTorch"
    pip_install "torch>=2.11"
  else
    echo "setup: installing a CPU build of PyTorch"
    pip_install "torch==2.13.0"
  fi
fi
echo "setup: installing torchloom and its dependencies"
if ! pip_install -e ".[dev]"; then
  # An offline machine that already has the runtime dependencies (a prepared GPU image, say)
  # can still run training: install torchloom alone, without fetching anything.
  runtime="import numpy, tokenizers, safetensors, rich, tensorboard, matplotlib, jinja2"
  if "$VENV/bin/python" -c "$runtime" 2>/dev/null; then
    echo "setup: could not install the dev tools; installing torchloom alone (tests need them)"
    pip_install --no-deps --no-build-isolation -e .
  else
    echo "setup: installing the dependencies failed; see pip's message above" >&2
    exit 1
  fi
fi
touch "$VENV/.torchloom-installed"

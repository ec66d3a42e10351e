# The two commands of the README: `make train` and `make test`. Both set up what is missing first.
# `make test-gpu` (on a machine with a CUDA GPU) runs every GPU test and a short GPU training run
# of each family; it uses .venv when there is one, else the machine's python3 (PY=... to choose).
# SHARD=I/N runs the I-th of N interleaved parts of them (the device's calls stop at ten minutes,
# and the whole suite takes nine to twelve, more with cold Triton caches: `make test-gpu
# SHARD=1/2`, then SHARD=2/2; or thirds, SHARD=1/3 to 3/3, one a call on a fresh machine).
VENV := .venv
BIN := $(VENV)/bin
RECIPE ?= llama3_tiny
PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

.PHONY: setup train test test-slow test-gpu lint format

setup: $(VENV)/.torchloom-installed

$(VENV)/.torchloom-installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

train: setup
	$(BIN)/torchloom train --recipe $(RECIPE) --output.dir outputs/$(RECIPE) --output.overwrite true

# make test: everything but the slow tests (about 10 minutes on 2 cores); make test-slow: the
# rest (the full multi-process layouts, the Triton interpreter sweep, inductor compiles).
test: setup lint
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

test-gpu:
	@$(PY) -c "import torch, sys; torch.cuda.is_available() or sys.exit('make test-gpu needs a CUDA GPU; this machine has none (make test skips the GPU tests)')"
	$(PY) -m pytest -q -m gpu -rs tests $(if $(SHARD),--shard $(SHARD))

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

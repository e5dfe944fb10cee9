# Two entry points: `make run` (set up, then the main job) and `make test` (set up, then the suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test test-quick test-all lint bench bench-transport clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/fl-run

test: $(STAMP)
	$(BIN)/pytest

test-quick: $(STAMP)  # a few minutes: contracts, smoke paths, one run of every strategy
	$(BIN)/pytest -m quick

test-all: $(STAMP)
	$(BIN)/pytest -m ''

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python experiments/bench_many_clients.py --clients 1000 --rounds 3 --repeats 3

bench-transport: $(STAMP)  # side channel vs Flower inline; streamed mean vs Flower's
	$(BIN)/python experiments/bench_transport.py --json experiments/out/bench_transport.json

clean:
	rm -rf $(VENV) outputs multirun

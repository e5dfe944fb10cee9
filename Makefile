# Two entry points: `make run` (set up, then the main job) and `make test` (set up, then the suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# our packages, read from pyproject's packages.find (as experiments/bench_many_clients.py
# reads them): their bytecode is compiled before each entry point, as pip does for an
# installed package, since an editable install never writes it where
# PYTHONDONTWRITEBYTECODE is set (containers): ~0.15 CPU s of every process otherwise
PACKAGES := $(shell sed -n 's/^include = \[\(.*\)\]/\1/p' pyproject.toml | tr -d '",*')

.PHONY: setup bytecode run test test-quick test-all lint bench bench-transport clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP) bytecode

bytecode: $(STAMP)  # only what changed since: ~0.04 s when nothing did
	$(BIN)/python -m compileall -q $(PACKAGES)

run: setup
	$(BIN)/fl-run

test: setup
	$(BIN)/pytest

test-quick: setup  # a few minutes: contracts, smoke paths, one run of every strategy
	$(BIN)/pytest -m quick

test-all: setup
	$(BIN)/pytest -m ''

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: setup
	$(BIN)/python experiments/bench_many_clients.py --clients 1000 --rounds 3 --repeats 3

bench-transport: $(STAMP)  # side channel vs Flower inline; streamed mean vs Flower's
	$(BIN)/python experiments/bench_transport.py --json experiments/out/bench_transport.json

clean:
	rm -rf $(VENV) outputs multirun

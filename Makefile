# Two commands for a fresh machine: `make demo` (the main job, end to end, no servers)
# and `make test`. Everything else here serves those two.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch that lies on these machines' disk; a GPU host passes its CUDA build
# (see README, "On a GPU host").
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed-stamp

.PHONY: install test-tools demo lint format test test-fast clean bench-env

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev,fast-load,real,lora]'
	touch $@

install: $(STAMP)

## What the tests need beside Python, from Debian's packages: Chromium + chromedriver (the
## Flower browser test), Prometheus + promtool (alert rules, dashboard queries).
test-tools:
	.ci/install-test-tools

## The main job: build the small model, migrate, start a worker and beat, warm, read history, stop.
demo: install
	$(BIN)/preheat dev demo

# Three pytest processes: most of an end-to-end test is waiting (a worker starting, a slot
# coming due, an outage lasting), so three share 2 cores well (measured on 2 cores: 7:24,
# against 9:16 with two). Each has its own Redis db and Postgres database
# (tests/conftest.py). Each takes the next test when it is done, the longest first
# (conftest's LONGEST_FIRST). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 3
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist load --maxschedchunk 1)

## ruff: lint and format check (configured in pyproject.toml); a finding fails `make test`.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The tests start a few hundred Python processes (workers, beats, CLI calls): where the
# environment turns bytecode caching off, each would compile the project's modules again.
BYTECODE_ON := PYTHONDONTWRITEBYTECODE=

## Every test, slow end-to-end ones included (real Redis, Postgres, worker processes).
test: install test-tools lint
	$(BYTECODE_ON) $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

## The quick loop: skips tests marked slow.
test-fast: install lint
	$(BYTECODE_ON) $(BIN)/python -m pytest $(XDIST) --skip-slow $(PYTEST_ARGS)

clean:
	rm -rf .preheat .pytest_cache .hypothesis

# `preheat bench load` compares with `transformers serve --continuous-batching`: its serving
# extras live in an environment of their own, so the product's stays as it ships.
BENCH_VENV := .bench-venv
bench-env: $(BENCH_VENV)/.installed-stamp
$(BENCH_VENV)/.installed-stamp: pyproject.toml
	python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(BENCH_VENV)/bin/pip install --quiet "transformers[serving]==$$($(BIN)/python -c 'import transformers; print(transformers.__version__)')"
	# llama.cpp's GGUF converter (`bench load`'s llama-server peer) reads the vocabulary with it.
	$(BENCH_VENV)/bin/pip install --quiet sentencepiece
	touch $@


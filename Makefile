# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv if missing, install torch pinned (the CPU build on these machines) and then the
# package with its extras. An unpinned torch would pull a multi-GB CUDA build.
# The interpreter of .venv: the distribution's Python 3.11 where it can make a venv and build C
# extensions, else `python3`. Why: Debian builds its python3.11 with PGO and LTO, pyenv's default build
# (the `python3` on PATH here) without; on these machines the simulator runs 1.1-1.3x and the test
# suite ~1.15x faster on it (docs/benchmarks.md, 2026-12-03 22:25 session). 3.11 because the torch file
# on disk is for 3.11. `make PY=...` picks another.
PY      ?= $(shell for p in /usr/bin/python3.11 python3; do $$p -c 'import ensurepip, os, sysconfig, venv; \
             assert os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
             2>/dev/null && { echo $$p; break; }; done)
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0
DEMO_DIR ?= .demo-model

.PHONY: demo test lint bench-offline sim-accel clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test,nixl]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/pdserve demo --model-dir $(DEMO_DIR)

lint: $(STAMP)
	$(BIN)/ruff check pdserve tests scripts
	$(BIN)/ruff format --check pdserve tests scripts

# Two parts (tests/conftest.py says why): the suite on two workers, then the quiet modules alone.
test: lint
	$(BIN)/python -m pytest -q -x -n 2 --dist loadfile -m "not quiet" --durations=15
	$(BIN)/python -m pytest -q -x -m quiet --durations=5

# The simulator's event loop compiled with mypyc (~30 s once; same results, ~2x faster); used by
# `pdserve simulate` while the sources match, ignored once they change.
sim-accel: $(STAMP)
	$(BIN)/python -m pdserve.sim.accel build

bench-offline: $(STAMP)
	$(BIN)/pdserve bench offline

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache

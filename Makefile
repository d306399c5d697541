# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv if missing, install torch pinned (the CPU build on these machines) and then the
# package with its extras. An unpinned torch would pull a multi-GB CUDA build.
PY      ?= python3
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

# gpuserv: the two commands a new machine needs (see README.md).
#   make run   set up .venv, pull the default model, run the smoke bench, then serve (Ctrl-C drains and stops)
#   make test  set up .venv, pull the default model, run the test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup model run test bench clean

setup: $(STAMP)

# torch is installed on its own first, pinned: a bare `pip install torch` (or a
# package that depends on it) would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

model: $(STAMP)
	$(BIN)/gpuserv pull smollm2

run: model
	$(BIN)/gpuserv bench --workload profiles/workloads/smoke.yaml --peers none --out bench/runs/smoke
	$(BIN)/gpuserv serve --demo "What is the capital of France? Answer in one sentence."

# PYTHONDONTWRITEBYTECODE is cleared for the run: the suite starts dozens of Python subprocesses (daemons, CLI
# runs, engine workers), and without cached bytecode each one compiles gpuserv's ~30k lines again (~0.5 s).
test: model
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q

bench: model
	$(BIN)/gpuserv bench --workload profiles/workloads/mixed-short-long.yaml --out bench/runs/mixed-short-long

clean:
	rm -rf $(VENV) bench/runs

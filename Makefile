# Each target sets up its own virtual environment with the pinned install, so a fresh machine needs only python3.
# GPU users: make TORCH="torch==2.13.* --index-url https://download.pytorch.org/whl/cuXYZ" ...  (see README, "Install")
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install demo test lint bench

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/accelerate launch --cpu recipes/grpo_long.py

# One thread per process: the tests' tiny models are dispatch-bound, and the two-process distributed tests would
# otherwise oversubscribe a 2-core CI machine (about 3x slower measured).
test: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=10

bench: install
	$(PY) benchmarks/bench_step.py

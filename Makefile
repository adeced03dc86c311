# Each target sets up its own virtual environment with the pinned install, so a fresh machine needs only python3.
# GPU users: make TORCH="torch==2.13.0 --index-url <PyTorch CUDA wheel index>" ...  (see README, "Install")
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

test: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/bench_step.py

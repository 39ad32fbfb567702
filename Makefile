# `make demo` and `make test` each set up .venv on their own (only Python 3.11 is needed).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench-gpu clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: on these machines 2.13.0 is a local CPU wheel; an open range would pull a CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/adapt demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check adapt tests

bench-gpu:
	PYTHONPATH=. python3 -m adapt.cli bench kernels --moe --dsa --output benchmarks

clean:
	rm -rf $(VENV) reports/demo

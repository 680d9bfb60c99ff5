# `make test` and `make demo` bootstrap .venv from nothing (a Python >= 3.12 is found on its own).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The HTTP server's extra (its tests run a server), and libtpu (the version jax[tpu] pins) where it
# has wheels (Linux x86-64): the tests compile the TPU kernels and programs with it for TPU
# topologies, on the CPU.
comma := ,
EXTRAS := $(if $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)),test$(comma)serve$(comma)tpu,test$(comma)serve)

PYTHON_FOR_VENV := $(shell for c in python3.12 python3.13 python3; do \
	  if command -v $$c >/dev/null 2>&1 && $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then command -v $$c; exit 0; fi; done; \
	  if command -v pyenv >/dev/null 2>&1; then for v in $$(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | sort -V -r); do \
	    echo "$$(pyenv root)/versions/$$v/bin/python3"; exit 0; done; fi)

.PHONY: test demo lint test-gpu clean fixtures

$(STAMP): pyproject.toml Makefile
	@if [ -z "$(PYTHON_FOR_VENV)" ]; then echo "error: Python >= 3.12 not found (install it, or pyenv install 3.12)"; exit 1; fi
	@test -x $(PY) || $(PYTHON_FOR_VENV) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15 -m "not gpu" tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

demo: $(STAMP)
	$(VENV)/bin/focus-jax demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# On a GPU machine whose python3 already has jax[cuda], jax-triton and tokamax (the H200 image
# plus their wheels): the GPU kernel tests.
test-gpu:
	JAX_PLATFORMS=cuda python3 -m pytest -m gpu tests

fixtures:
	python3 scripts/make_parity_fixtures.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

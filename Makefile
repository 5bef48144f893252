# The two set-up commands of the README: `make lab` (the main job) and `make test` (the whole suite).
# Each creates .venv when it is missing. By default the venv gets the CPU build of torch from local disk.
# GPU users keep their own CUDA torch:  make test VENV_FLAGS=--system-site-packages TORCH=
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH ?= torch==2.13.0 triton==3.9.0
EXTRAS ?= dev,hf,browser,flashinfer
PY := $(VENV)/bin/python

.PHONY: lab test lint browser-deps clean

# The extras are installed with the torch already in the venv named, so none can swap it for a (CUDA) build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(if $(strip $(TORCH)),$(PY) -m pip install -q $(TORCH))
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" "$$($(PY) -c 'import torch; print("torch==" + torch.__version__.split("+")[0])')"
	touch $@

lab: $(VENV)/.installed
	$(PY) -m moelab.lab --out build

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 --durations=15

lint: $(VENV)/.installed
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build

# System packages the browser test needs (Debian's Chromium, driven by Playwright; no browser download).
browser-deps:
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)

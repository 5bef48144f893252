# The two set-up commands of the README: `make lab` (the main job) and `make test` (the whole suite).
# Each creates .venv when it is missing; `make lab` installs what the notebooks need (the `lab` extra), `make test`
# adds the test set (the `test` extra, FlashInfer's Python package among it) and Debian's Chromium when missing.
# By default the venv gets the CPU build of torch (from local disk where a wheel lies there).
# GPU users keep their own CUDA torch:  make lab VENV_FLAGS=--system-site-packages TORCH=
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH ?= torch==2.13.0 triton==3.9.0
# Where pip also looks for torch: PyPI's Linux torch is the CUDA build (NVIDIA libraries, several GB). Without a
# local CPU wheel, pass PyTorch's CPU index:  make lab TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
LAB_EXTRAS ?= lab
TEST_EXTRAS ?= test
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
# The installed torch's version, read from its metadata (importing torch before NumPy is installed warns).
TORCH_PIN = "torch==$$($(PY) -c 'from importlib.metadata import version; print(version("torch").split("+")[0])')"

.PHONY: lab test lint browser-deps clean

# The extras are installed with the torch already in the venv pinned, so none can swap it for a (CUDA) build.
$(VENV)/.lab: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(if $(strip $(TORCH)),$(PIP) $(TORCH) $(if $(strip $(TORCH_INDEX)),--extra-index-url $(TORCH_INDEX)))
	$(PIP) -e ".[$(LAB_EXTRAS)]" $(TORCH_PIN)
	touch $@

$(VENV)/.test: $(VENV)/.lab
	$(PIP) -e ".[$(TEST_EXTRAS)]" $(TORCH_PIN)
	touch $@

lab: $(VENV)/.lab
	$(PY) -m moelab.lab --out build/lab

test: $(VENV)/.test browser-deps
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 --durations=15

lint: $(VENV)/.test
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build

# Debian's Chromium for the browser test (Playwright drives it; no browser download). Installed with apt when
# missing: as root directly, else through sudo when it asks no password. Anyone else: install the `chromium`
# package once, or point MOELAB_CHROMIUM at a Chromium or Chrome binary (tests/test_browser.py uses it).
browser-deps:
	@if [ -n "$$MOELAB_CHROMIUM" ] || command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then \
	  :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's chromium (apt-get) for the browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	elif sudo -n true 2>/dev/null; then \
	  echo "installing Debian's chromium (sudo apt-get) for the browser test"; \
	  sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else \
	  echo "The browser test needs Chromium: run 'sudo apt-get install chromium' once," \
	       "or set MOELAB_CHROMIUM=/path/to/chromium (or chrome)." >&2; \
	  exit 1; \
	fi

# The two set-up commands of the README: `make lab` (the main job) and `make test` (the whole suite).
# Each creates .venv when it is missing; `make lab` installs what the notebooks need (the `lab` extra), `make test`
# adds the test set (the `test` extra, FlashInfer's Python package among it) and a browser when none is there
# (Debian's Chromium as root, else Qt WebEngine from PyPI: see browser-deps).
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

.PHONY: lab test lint sm90-compile sm90-launches browser-deps clean

# A venv made by a Python that runs in a venv itself (a CUDA torch often lives in one) sees, with
# --system-site-packages, the base installation's site-packages but not that venv's: a .pth file adds them.
OUTER_VENV_PTH = $(PYTHON) -c 'import site, sys; sys.prefix == sys.base_prefix or open(sys.argv[1] + "/outer-venv.pth", "w").write("\n".join(site.getsitepackages()) + "\n")' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"

# The extras are installed with the torch already in the venv pinned, so none can swap it for a (CUDA) build.
$(VENV)/.lab: pyproject.toml
	test -x $(PY) || { $(PYTHON) -m venv $(VENV_FLAGS) $(VENV) $(if $(findstring --system-site-packages,$(VENV_FLAGS)),&& $(OUTER_VENV_PTH)); }
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
	rm -rf $(VENV) $(SM90_VENV) build

# The GEMM, segments and Gluon kernels (scripts/ptx_sm90.py: the routed GEMMs in their variants, warp-specialised
# and TMA ones too) compiled for sm_90 (no GPU needed) under the Triton a GPU machine runs, before GPU time is spent
# on a kernel change: another Triton can reject a kernel the tests' Triton compiles (or build it differently). Its
# own venv: torch's CPU build (which pins no Triton: from local disk, or pass TORCH_INDEX as for `make lab`) and that
# Triton; the PTX lands in build/ptx-sm90.
# LAUNCHES=<folder> adds every kernel launch the tests recorded there (`make sm90-launches` records them: the
# kernel files' tests with MOELAB_RECORD_LAUNCHES, tests/conftest.py), each at the tests' own interpreter tiles.
#   make sm90-compile                      # Triton 3.6.0, the one a CUDA torch 2.11 pins
#   make sm90-compile GPU_TRITON=3.5.1 TORCH_INDEX=https://download.pytorch.org/whl/cpu
#   make sm90-launches && make sm90-compile LAUNCHES=build/launches
GPU_TRITON ?= 3.6.0
SM90_TORCH ?= torch==2.13.0
SM90_VENV ?= .venv-sm90
LAUNCHES ?=
LAUNCH_TESTS ?= tests/test_routed_moe.py tests/test_token_major.py tests/test_lora.py tests/test_lora_banks.py \
  tests/test_kernel_activations.py tests/test_moe_gemm_order.py tests/test_packing.py
sm90-compile:
	test -x $(SM90_VENV)/bin/python || $(PYTHON) -m venv $(SM90_VENV)
	$(SM90_VENV)/bin/python -m pip install -q --disable-pip-version-check $(SM90_TORCH) triton==$(GPU_TRITON) \
	  "numpy<2.4" $(if $(strip $(TORCH_INDEX)),--extra-index-url $(TORCH_INDEX))
	PYTHONPATH=$(CURDIR) $(SM90_VENV)/bin/python scripts/ptx_sm90.py build/ptx-sm90 --gluon --segments --options \
	  --tma --ws $(if $(strip $(LAUNCHES)),--launched $(LAUNCHES))

sm90-launches: $(VENV)/.test
	rm -rf build/launches
	MOELAB_RECORD_LAUNCHES=build/launches $(PY) -m pytest -q -n 2 -p no:cacheprovider $(LAUNCH_TESTS)

# The browser test's browser, from the package registries only (no browser download). Debian's Chromium when no
# chromium is on the PATH: with apt as root (CI), else through sudo when it asks no password. Anyone else gets Qt
# WebEngine, the Chromium in PyQt6-WebEngine's wheels on PyPI, in the venv (the `browser-qt` extra);
# tests/test_browser.py drives whichever is there. MOELAB_CHROMIUM=/path/to/chromium (or chrome) skips all this.
QT_WEBENGINE_THERE = $(PY) -c 'import importlib.util as u, sys; sys.exit(u.find_spec("PyQt6.QtWebEngineWidgets") is None)'
browser-deps: $(VENV)/.test
	@if [ -n "$$MOELAB_CHROMIUM" ] || command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then \
	  :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's chromium (apt-get) for the browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	elif sudo -n true 2>/dev/null; then \
	  echo "installing Debian's chromium (sudo apt-get) for the browser test"; \
	  sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	elif $(QT_WEBENGINE_THERE) 2>/dev/null; then \
	  :; \
	else \
	  echo "no chromium and no root: installing Qt WebEngine (PyQt6-WebEngine, PyPI) into $(VENV) for the browser test"; \
	  $(PIP) -e ".[browser-qt]" $(TORCH_PIN); \
	fi

#!/usr/bin/env bash
# The GPU box's set-up, measured on the lent H200 (which reaches no package registry): the README's GPU command,
#   make lab VENV_FLAGS=--system-site-packages TORCH=
# with pip pointed at carried wheels (PIP_NO_INDEX=1, PIP_FIND_LINKS), timed in its two parts: the install (.venv on
# top of the image's CUDA torch, plus the `lab` extra) and then the notebooks at full size. Reports seconds, the
# venv's disk (du) and what pip put in it; logs under $OUT. About 1 + 3 minutes.
#
# 1. Here, with the registries (once; not committed, .git/info/exclude has /.whl-lab/):
#      PYTHON=python3.12 bash scripts/device_install.sh download
#    resolves the `lab` extra (read from pyproject.toml) plus setuptools (pip's isolated build of moelab needs it)
#    for CPython 3.12 on manylinux x86-64, keeps the wheels the H200 image lacks (KINDS.md's package list, below)
#    and the image's small ones (< 1 MB, in case its versions are older than a requirement: pip takes them only
#    then), and packs them into .whl-lab/lab-wheels.tar.xz. The wheels go in uncompressed (stored) so that xz packs
#    their contents: about 33 MiB instead of 48 (as deflated wheels). Unpacking them costs no time that is measured;
#    stored wheels install a little faster than deflated ones (no inflate: well under a second for these).
# 2. On the H200, from the repo root:
#      run(command="bash scripts/device_install.sh", carry=[".whl-lab"], timeout_s=420)
set -uo pipefail
cd "$(dirname "$0")/.."
WHL=.whl-lab
PACK=$WHL/lab-wheels.tar.xz

# The H200 image's Python packages (KINDS.md, read 2026-11-17).
IMAGE_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow
pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

if [ "${1:-}" = download ]; then
  # A Python 3.12, as on the H200: pip download evaluates the requirements' markers (papermill's
  # `aiohttp; python_version == "3.12"`) with the Python that runs it, whatever --python-version says.
  PY=${PYTHON:-python3.12}
  $PY -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || { echo "$PY is not Python 3.12"; exit 1; }
  tmp=$(mktemp -d)
  mapfile -t LAB < <($PY -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["lab"], sep="\n")')
  echo "lab extra: ${LAB[*]}"
  $PY -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    --platform linux_x86_64 -d "$tmp/all" "${LAB[@]}" "setuptools>=68" 2>&1 | grep -v "is ignored" || true
  mkdir -p "$WHL"
  IMAGE_HAS="$IMAGE_HAS" $PY - "$tmp/all" "$tmp/stored" "$PACK" <<'EOF'
import os, re, sys, tarfile, zipfile
from pathlib import Path

src, stored, pack = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
image = set(map(norm, os.environ["IMAGE_HAS"].split())) - {"setuptools"}
stored.mkdir()
kept, left = [], []
for whl in sorted(src.glob("*.whl")):
    name = norm(whl.name.split("-")[0])
    if name in image and whl.stat().st_size >= 2**20:
        left.append(whl.name)
        continue
    kept.append(whl)
    with zipfile.ZipFile(whl) as zi, zipfile.ZipFile(stored / whl.name, "w", zipfile.ZIP_STORED) as zo:
        for info in zi.infolist():
            zo.writestr(info, zi.read(info), compress_type=zipfile.ZIP_STORED)
with tarfile.open(pack, "w:xz") as tar:
    for whl in sorted(stored.glob("*.whl")):
        tar.add(whl, arcname=whl.name)
mib = lambda n: f"{n / 2**20:.1f} MiB"
print(f"kept {len(kept)} wheels ({mib(sum(w.stat().st_size for w in kept))} as downloaded); "
      f"left out (the image has them): {', '.join(left)}")
print(f"{pack}: {mib(pack.stat().st_size)}")
EOF
  rm -rf "$tmp"
  exit 0
fi

# ---------------------------------------------------------------------------------------------- on the H200
export PYTHONUNBUFFERED=1
OUT=${OUT:-build/device_install}; mkdir -p "$OUT"
[ -f "$PACK" ] || { echo "no $PACK: run 'bash scripts/device_install.sh download' first, then carry $WHL"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "python3: $(command -v python3) ($(python3 -c 'import sys; print(sys.version.split()[0], "venv" if sys.prefix != sys.base_prefix else "base")'))"
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
FIND=/tmp/whl-lab
rm -rf "$FIND" && python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$PACK" "$FIND"
echo "wheels: $(ls "$FIND" | wc -l) in $FIND ($(du -sh "$FIND" | cut -f1))"

FLAGS=--system-site-packages
if ! python3 -c 'import ensurepip' 2>/dev/null; then
  FLAGS="--system-site-packages --without-pip"  # .venv's pip is then the image's, through the outer venv's .pth
  echo "python3 has no ensurepip: VENV_FLAGS='$FLAGS'"
fi
rm -rf .venv build/lab
export PIP_NO_INDEX=1 PIP_FIND_LINKS=$FIND

echo "== 1. install: make .venv/.lab VENV_FLAGS='$FLAGS' TORCH=  (what make lab does before the notebooks)"
t0=$(date +%s.%N)
timeout ${INSTALL_S:-180} make .venv/.lab VENV_FLAGS="$FLAGS" TORCH= > "$OUT/install.log" 2>&1
rc=$?
t1=$(date +%s.%N)
grep -v "is ignored" "$OUT/install.log" | tail -15
echo "install: rc=$rc, $(python3 -c "print(f'{$t1 - $t0:.1f}')") s; .venv: $(du -sh .venv | cut -f1)"
.venv/bin/python -m pip list --path "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
  --disable-pip-version-check 2>/dev/null > "$OUT/venv_packages.txt"
echo "packages in .venv itself: $(($(wc -l < "$OUT/venv_packages.txt") - 2))"
du -sh .venv/lib/python3*/site-packages/* 2>/dev/null | sort -h | tail -8
.venv/bin/python -c "import torch, moelab, papermill, jupyterlab; print('in .venv: torch', torch.__version__, torch.__file__, '| cuda', torch.cuda.is_available())"
[ "$rc" = 0 ] || exit $rc

echo "== 2. notebooks: make lab VENV_FLAGS='$FLAGS' TORCH=  (the venv is there: this runs moelab.lab only)"
t0=$(date +%s.%N)
timeout ${NB_S:-240} make lab VENV_FLAGS="$FLAGS" TORCH= > "$OUT/lab.log" 2>&1
rc=$?
t1=$(date +%s.%N)
tail -15 "$OUT/lab.log"
echo "notebooks: rc=$rc, $(python3 -c "print(f'{$t1 - $t0:.1f}')") s; build/lab: $(du -sh build/lab 2>/dev/null | cut -f1)"
exit $rc

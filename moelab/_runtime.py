"""Where moelab runs: the capability probe every backend consults.

On a machine without a CUDA GPU moelab's Triton kernels run in Triton's CPU interpreter, so ``import moelab``
works on a laptop or CI box with no environment variable set by hand. The interpreter is scoped to moelab's own
kernels (:func:`moelab.kernels._common.jit`, :mod:`moelab.kernels.interpret`): it is on only while one of them
runs, and ``import moelab`` sets no environment variable and no Triton knob, so every other Triton kernel of the
process (Liger's, torch.compile's, the user's own) is compiled as it would be without moelab, and child processes
(pytest-xdist workers, torch.distributed ranks) decide for themselves when they import moelab.

``TRITON_INTERPRET``, Triton's own switch, still rules where it is set (read once, at import, the way Triton reads
it): ``TRITON_INTERPRET=1`` interprets every Triton kernel of the process, moelab's included, also next to a GPU;
``TRITON_INTERPRET=0`` interprets none: moelab's kernels are compiled, so on a CPU its triton backend is unavailable
and its ops take their torch paths (how the CPU ranks of ``moelab.distributed``'s tests and ``--tiny`` bench run).
"""

from __future__ import annotations

import os

import torch

try:
    import triton

    HAS_TRITON = True
except ImportError:  # e.g. macOS: no triton wheel
    HAS_TRITON = False

#: True when moelab's Triton kernels run in Triton's CPU interpreter (numpy under the hood): ``TRITON_INTERPRET``
#: as Triton parses it where set, else where no CUDA GPU is found.
INTERPRET: bool = (not torch.cuda.is_available() if os.environ.get("TRITON_INTERPRET") is None
                   else HAS_TRITON and triton.knobs.runtime.interpret)


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string: "3.6.0+git1" -> (3, 6)."""
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_interpreter_numpy(triton_version: str, numpy_version: str | None) -> None:
    """Triton's CPU interpreter before 3.7 fails inside every kernel with NumPy >= 2.4 ("only 0-dimensional arrays
    can be converted to Python scalars"). A CUDA torch 2.11 pins triton 3.6, so ``pip install moelab`` next to it
    may bring in that pair on a machine without a GPU: refuse it at import, with the fix."""
    if numpy_version is None or _version(triton_version) >= (3, 7) or _version(numpy_version) < (2, 4):
        return
    raise ImportError(
        f"moelab runs Triton kernels in Triton's CPU interpreter here (no CUDA GPU), and triton {triton_version} "
        f"with numpy {numpy_version} cannot: Triton's interpreter before 3.7 fails with NumPy >= 2.4. "
        f"Fix: pip install 'numpy<2.4' (or a torch whose triton is >= 3.7)")


if HAS_TRITON and INTERPRET:
    from importlib.metadata import PackageNotFoundError, version

    try:
        _numpy_version = version("numpy")
    except PackageNotFoundError:
        _numpy_version = None
    check_interpreter_numpy(triton.__version__, _numpy_version)


def cuda_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """(major, minor) of the CUDA device, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


#: Programmatic dependent launch between the pipeline's kernels while a CUDA graph is captured (Hopper and newer,
#: compiled Triton only): each kernel is launched with ``launch_pdl`` and starts with
#: :func:`moelab.kernels._common.wait_for_previous_kernel`, so the next kernel's programs are scheduled while the
#: previous kernel's last ones still run, and wait there until its writes are visible. Measured on the H200
#: (BENCHMARKS.md): in a graph T=32 272 vs 274.4 µs; eagerly T=128 366-412 vs 319 µs, so eager calls launch
#: without it. ``MOELAB_PDL=0`` turns it off.
PDL: bool = os.environ.get("MOELAB_PDL", "1") == "1"
_hopper_devices: dict[int, bool] = {}


def is_hopper_or_newer(device: torch.device) -> bool:
    """Whether the CUDA ``device`` is of compute capability 9.0 or newer (read once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _hopper_devices:
        _hopper_devices[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _hopper_devices[index]


def pdl_launch(device: torch.device) -> dict:
    """Launch options of a pipeline kernel on ``device``: ``USE_GDC`` and ``launch_pdl`` while a CUDA graph is
    captured on an SM 9.0+ GPU, else none (eager calls, the interpreter, CPU tensors, ``PDL`` off)."""
    if not PDL or INTERPRET or device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return {}
    return {"USE_GDC": True, "launch_pdl": True} if is_hopper_or_newer(device) else {}


def ensure_triton_allocator() -> None:
    """Give Triton an allocator for the global scratch its on-device TMA descriptors need (``torch.empty`` on the
    launch's device), unless the process set one; Triton's default allocator raises. Called by the GEMM launchers
    before a TMA launch (the allocator is per thread in Triton)."""
    from triton.runtime import _allocation  # imported here: only TMA launches need it

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's global scratch: ``size`` bytes on the current CUDA device (torch's allocator aligns to 512 B)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def triton_can_run(device: torch.device) -> bool:
    """Triton runs compiled on any CUDA device, and in its interpreter on CPU tensors."""
    if not HAS_TRITON:
        return False
    return device.type == "cuda" or INTERPRET


#: Fill dead and padding rows of permuted buffers with NaN instead of zeros, so a consumer that reads a row
#: it should only reach through ``expanded_idx_to_permuted_idx`` fails loudly. ``MOELAB_DEBUG=1`` or
#: :func:`set_debug` turn it on.
DEBUG_DEAD_ROWS: bool = os.environ.get("MOELAB_DEBUG", "0") == "1"


def dead_row_fill() -> float:
    """The value dead and padding rows of permuted buffers hold: NaN under :func:`set_debug`, else 0.0."""
    return float("nan") if DEBUG_DEAD_ROWS else 0.0


def default_device() -> torch.device:
    """Where moelab runs when no device is named: the current CUDA GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def set_debug(enabled: bool) -> None:
    """Dead rows of permuted outputs become NaN (True) or zeros (False, the default); same as ``MOELAB_DEBUG=1``.

    Example:
        >>> import moelab
        >>> moelab.set_debug(True)   # a consumer that reads a dead row now gets NaN
        >>> moelab.set_debug(False)
    """
    global DEBUG_DEAD_ROWS
    DEBUG_DEAD_ROWS = bool(enabled)

"""Where moelab runs: the capability probe every backend consults.

Imported first by ``moelab/__init__.py``. On a machine without a CUDA GPU it switches Triton to its
interpreter (``TRITON_INTERPRET=1``) *before* any kernel is defined, so ``import moelab`` works on a laptop
or CI box with no environment variable set by hand.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: True when Triton kernels run in Triton's CPU interpreter (numpy under the hood).
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # e.g. macOS: no triton wheel
    HAS_TRITON = False


def cuda_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """(major, minor) of the CUDA device, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def triton_can_run(device: torch.device) -> bool:
    """Triton runs compiled on any CUDA device, and in its interpreter on CPU tensors."""
    if not HAS_TRITON:
        return False
    return device.type == "cuda" or INTERPRET


#: Fill dead and padding rows of permuted buffers with NaN instead of zeros, so a consumer that reads a row
#: it should only reach through ``expanded_idx_to_permuted_idx`` fails loudly. ``MOELAB_DEBUG=1`` or
#: :func:`set_debug` turn it on.
DEBUG_DEAD_ROWS: bool = os.environ.get("MOELAB_DEBUG", "0") == "1"


def set_debug(enabled: bool) -> None:
    """Dead rows of permuted outputs become NaN (True) or zeros (False, the default)."""
    global DEBUG_DEAD_ROWS
    DEBUG_DEAD_ROWS = bool(enabled)

"""A CPU stand-in for CUDA's caching allocator, for the outputs of eager calls replayed in place.

In-place graphs (``moelab/backends/eager_graphs.py``) and the signatures of plain calls go by the output's address.
A GPU decode loop frees each step's output before the next step asks for one of the same size, and CUDA's caching
allocator hands the freed block back; the CPU's malloc may hand out another. ``ReusingTorch()`` stands for the
``torch`` module inside ``eager_graphs`` and ``moelab.experts`` (assign it to their ``torch``): every name is
torch's, but ``empty`` hands back the block of the last tensor of that shape and dtype once that tensor is gone.
Used by ``scripts/host_cost.py --stub-replays`` and the CPU replays of ``tests/test_eager_graphs.py``.
"""

from __future__ import annotations

import weakref

import torch


class ReusingTorch:
    """``torch``, with an ``empty(*shape, dtype, device)`` that reuses freed blocks (module docstring)."""

    def __init__(self):
        self.__dict__.update(vars(torch))  # torch's names at an instance lookup's cost (host_cost times them)
        self.empty = self._empty
        self.blocks = {}  # (shape, dtype) -> (the block, a weak reference to the tensor last handed out)

    def __getattr__(self, name):  # names torch loads lazily
        return getattr(torch, name)

    def _empty(self, *shape, dtype, device):
        shape = tuple(shape[0]) if len(shape) == 1 else shape
        block, last = self.blocks.get((shape, dtype), (None, None))
        if block is None or last() is not None:
            block = torch.empty(shape, dtype=dtype, device=device)
        out = block.view(block.shape)
        self.blocks[shape, dtype] = (block, weakref.ref(out))
        return out

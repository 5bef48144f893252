"""Argument checks shared by every public entry point (SPEC §7).

Each raises ``TypeError`` for a wrong type/dtype and ``ValueError`` for a wrong shape, device, value or range,
naming the argument, what was expected and what was given.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

#: The packed word keeps the expert id in a signed int16.
MAX_EXPERTS = 32767


def check_tensor(name: str, x, *, dtypes=None, ndim: int | None = None, shape=None) -> torch.Tensor:
    """Check type, dtype, rank and (where given, ``None`` = any) the sizes of ``x``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        want = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({want}), got {str(x.dtype).replace('torch.', '')}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(x.shape)}")
    if shape is not None:
        if x.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, x.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(x.shape)}")
    return x


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All named tensors on one device; returns it."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(f"{name}: expected device {first} (that of {first_name}), got {dev}")
    return first


def check_contiguous(name: str, x: torch.Tensor) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (strides {x.stride()} for shape "
                         f"{tuple(x.shape)}); call .contiguous() first")


def check_int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """An int in [low, high] (inclusive where given)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name}: expected an int in [{low}, {high}], got {value}")
    return value


def check_in_range(name: str, values: torch.Tensor, low: int, high: int, what: str, note: str = "") -> None:
    """Every element of ``values`` in [low, high), else a ValueError naming ``what`` and the first offending
    extreme. Reads device data (one host sync); an empty tensor passes."""
    if values.numel() == 0:
        return
    lo, hi = torch.stack([values.min(), values.max()]).tolist()
    if lo < low or hi >= high:
        raise ValueError(f"{name}: expected {what} in [{low}, {high}){note}, got {lo if lo < low else hi}")


def check_expert_ids(name: str, ids: torch.Tensor, num_experts: int, *, check_duplicates: bool = True) -> None:
    """Every id in [0, num_experts) and, where asked, no id twice in one token (one row). Reads device data."""
    if ids.numel() == 0:
        return
    check_in_range(name, ids, 0, num_experts, "expert ids")
    if check_duplicates and ids.shape[-1] > 1:
        s = ids.sort(dim=-1).values
        dup = (s[..., 1:] == s[..., :-1]).any(dim=-1)
        if bool(dup.any()):
            t = int(dup.nonzero()[0, 0])
            raise ValueError(f"{name}: expected distinct expert ids per token, token {t} has "
                             f"{ids[t].tolist()}")

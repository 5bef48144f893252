"""Argument checks shared by every public entry point (docs/contract.md §7).

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
    """All named tensors (``None`` skipped) on one device; returns it. The message names both sides, since either
    may be the one to move."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(f"{name}: expected the device of {first_name} ({first}), got {dev}; every tensor of "
                             f"this call must be on one device (move {name} or {first_name} with .to(device))")
    return first


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_dtype(name: str, x: torch.Tensor, dtype: torch.dtype, of: str) -> None:
    """``x`` has ``dtype``, that of ``of`` (e.g. "the weights"); the one wording of every dtype mismatch."""
    if x.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype_name(dtype)} (that of {of}), got {dtype_name(x.dtype)}; "
                        f"convert it with {name.split(' ')[0]}.to({dtype})")


def check_same_rows(**tensors) -> int:
    """Every named tensor has the same number of rows (T); returns it. On a mismatch the message blames the
    tensors whose T differs from the one most of them share, and lists every T."""
    rows = {name: t.shape[0] for name, t in tensors.items() if t is not None}
    values = list(rows.values())
    if len(set(values)) <= 1:
        return values[0]
    common = max(values, key=lambda v: (values.count(v), -values.index(v)))
    odd = [name for name, v in rows.items() if v != common]
    listed = ", ".join(f"{name} {v}" for name, v in rows.items())
    raise ValueError(f"{odd[0]}: expected {common} rows (T, as {', '.join(n for n in rows if rows[n] == common)}), "
                     f"got {rows[odd[0]]}; rows per argument: {listed}")


def check_no_overlap(name: str, out: torch.Tensor, **inputs) -> None:
    """``out`` (written in place) shares no memory with any of ``inputs`` (``None`` skipped): a kernel that reads
    an input while writing an overlapping output computes garbage."""
    if out.numel() == 0:
        return
    start = out.data_ptr()
    end = start + _span(out) * out.element_size()
    for other_name, t in inputs.items():
        if t is None or t.numel() == 0 or t.device != out.device:
            continue
        o_start = t.data_ptr()
        o_end = o_start + _span(t) * t.element_size()
        if start < o_end and o_start < end:
            raise ValueError(f"{name}: shares memory with {other_name}; a kernel reads {other_name} while it writes "
                             f"{name}, so pass a separate {name} (e.g. torch.empty_like({name}))")


def _span(t: torch.Tensor) -> int:
    """Elements from the first to one past the last element ``t`` addresses (non-negative strides)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def check_contiguous(name: str, x: torch.Tensor) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (strides {x.stride()} for shape "
                         f"{tuple(x.shape)}); call .contiguous() first")


def check_int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """An int in [low, high] (inclusive where given)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value > high):
        want = f"in [{low}, {high}]" if low is not None and high is not None else (
            f">= {low}" if low is not None else f"<= {high}")
        raise ValueError(f"{name}: expected an int {want}, got {value}")
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


def check_expert_weights(w13, w2) -> tuple[int, int, int]:
    """HF-order expert weights: ``w13 [E_local, 2I, H]`` (rows [gate; up]) and ``w2 [E_local, H, I]``, one float
    dtype and device. Returns (E_local, H, I). A transposed ``w13`` or ``w2`` is named as such: the shapes are
    read against each other, so the tensor that does not fit the other is the one blamed."""
    check_tensor("w13", w13, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("w2", w2, dtypes=FLOAT_DTYPES, ndim=3)
    E_local, two_i, H = w13.shape
    fits = w2.shape[0] == E_local and w2.shape[1] == H and 2 * w2.shape[2] == two_i
    if not fits:
        e2, h2, i2 = w2.shape
        if w2.shape[0] == E_local and (w13.shape[1], w13.shape[2]) == (h2, 2 * i2):
            raise ValueError(f"w13: expected shape [E_local, 2I, H] = [{E_local}, {2 * i2}, {h2}] (rows [gate; up], "
                             f"the w2 [E_local, H, I] = {list(w2.shape)} given), got {list(w13.shape)}: it looks "
                             f"transposed; pass w13.transpose(1, 2)")
        if w2.shape[0] == E_local and two_i % 2 == 0 and (h2, i2) == (two_i // 2, H):
            raise ValueError(f"w2: expected shape [E_local, H, I] = [{E_local}, {H}, {two_i // 2}] (from w13 "
                             f"[E_local, 2I, H] = {list(w13.shape)}), got {list(w2.shape)}: it looks transposed; "
                             f"pass w2.transpose(1, 2)")
    if two_i % 2:
        raise ValueError(f"w13: expected an even second dimension 2I (rows [gate; up]), got shape {list(w13.shape)}")
    I = two_i // 2
    if min(E_local, H, I) == 0:
        raise ValueError(f"w13: expected non-zero E_local, 2I and H, got shape {list(w13.shape)}")
    check_tensor("w2", w2, shape=(E_local, H, I))
    check_dtype("w2", w2, w13.dtype, "w13")
    check_same_device(w13=w13, w2=w2)
    return E_local, H, I

"""Assertions that say what is wrong: which rows fail, and what those rows have in common.

The notebooks check moelab against ``moelab.reference``; when a check fails, "rel err 0.31 >= 0.01" says *that*
something is off, not *where*. These helpers name the failing rows and test them against the facts the
notebook knows (``map == -1``, "has an adapter", "weight's sign bit set", ...), so a failure reads

    output: rel err 3.1e-01 >= 1e-02; tokens 3, 17 (2 of 16) are off by more than 1e-02; all 2 have a slot
    with map == -1 (0 of the 14 others)

Each ``assert_*`` raises ``AssertionError`` with such a message, or returns quietly.

Example:
    >>> import torch
    >>> ref = torch.ones(4, 3); out = ref.clone(); out[2] = 5.0
    >>> try:
    ...     assert_close("output", out, ref, tol=1e-2, facts={"an adapter": torch.tensor([0, 0, 1, 0]) > 0})
    ... except AssertionError as e:
    ...     print(e)
    output: rel err 2.0e+00 >= 1e-02; token 2 (1 of 4) is off by more than 1e-02; it has an adapter (0 of the 3 others)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["row_list", "describe", "row_errors", "assert_close", "assert_equal", "assert_rows"]


def _bool(mask) -> torch.Tensor:
    return torch.as_tensor(mask).detach().to("cpu").reshape(-1).bool()


def row_list(mask, row: str = "token", *, limit: int = 8) -> str:
    """``"tokens 3, 17 (2 of 16)"``: the rows where ``mask`` [N] is True, at most ``limit`` named."""
    mask = _bool(mask)
    rows = torch.nonzero(mask).flatten().tolist()
    if not rows:
        return f"no {row} (0 of {mask.numel()})"
    named = ", ".join(str(r) for r in rows[:limit]) + (", ..." if len(rows) > limit else "")
    return f"{row}{'s' if len(rows) > 1 else ''} {named} ({len(rows)} of {mask.numel()})"


def describe(bad, facts: Mapping[str, object] | None) -> str:
    """What the rows where ``bad`` [N] is True have in common with each fact (bool [N]), against the others:
    ``"all 2 have map == -1 (0 of the 14 others)"``."""
    bad = _bool(bad)
    parts = []
    n_bad, n_good = int(bad.sum()), int((~bad).sum())
    for label, fact in (facts or {}).items():
        fact = _bool(fact)
        if fact.numel() != bad.numel():
            raise ValueError(f"facts[{label!r}]: expected {bad.numel()} entries (one per row), got {fact.numel()}")
        in_bad, in_good = int((fact & bad).sum()), int((fact & ~bad).sum())
        if n_bad == 1:
            head = f"it has {label}" if in_bad else f"it does not have {label}"
        elif in_bad == n_bad:
            head = f"all {n_bad} have {label}"
        elif in_bad == 0:
            head = f"none of them has {label}"
        else:
            head = f"{in_bad} of them {'has' if in_bad == 1 else 'have'} {label}"
        parts.append(f"{head} ({in_good} of the {n_good} others)")
    return "; ".join(parts)


def row_errors(out, ref) -> torch.Tensor:
    """float64 [N]: ``||out[r] - ref[r]|| / ||ref[r]||`` of each row (the whole tensor's rms when a reference row
    is zero); inf where ``out`` has a NaN or an infinity."""
    out64 = torch.as_tensor(out).detach().to("cpu", torch.float64)
    ref64 = torch.as_tensor(ref).detach().to("cpu", torch.float64)
    if out64.shape != ref64.shape:
        raise ValueError(f"out: expected the reference's shape {list(ref64.shape)}, got {list(out64.shape)}")
    out64, ref64 = out64.reshape(out64.shape[0], -1), ref64.reshape(ref64.shape[0], -1)
    scale = ref64.norm(dim=1)
    typical = ref64.norm() / max(ref64.shape[0], 1) ** 0.5  # the rms of the rows' norms
    scale = torch.where(scale > 0, scale, typical if typical > 0 else torch.ones((), dtype=torch.float64))
    err = (out64 - ref64).norm(dim=1) / scale
    return torch.where(torch.isfinite(out64).all(dim=1), err, torch.full_like(err, float("inf")))


def assert_close(name: str, out, ref, *, tol: float, facts: Mapping[str, object] | None = None,
                 row: str = "token") -> float:
    """Raise unless ``||out - ref|| / ||ref|| < tol`` (float64, NaN never passes); the message names the rows
    whose own relative error is at least ``tol`` and what they share (``facts``: label -> bool [rows]).

    Returns the relative error.
    """
    from moelab.lab import rel_err

    err = rel_err(out, ref)
    if err < tol:
        return err
    per_row = row_errors(out, ref)
    bad = ~(per_row < tol)
    msg = f"{name}: rel err {err:.1e} >= {tol:.0e}; "
    if bad.any():
        n = int(bad.sum())
        msg += f"{row_list(bad, row)} {'are' if n > 1 else 'is'} off by more than {tol:.0e}"
        if torch.isinf(per_row).any():
            msg += f" ({row_list(torch.isinf(per_row), row)} hold NaN or inf)"
        explained = describe(bad, facts)
        msg += f"; {explained}" if explained else ""
    else:
        msg += f"spread over every {row} (none alone reaches {tol:.0e})"
    raise AssertionError(msg)


def assert_equal(name: str, got, want, *, facts: Mapping[str, object] | None = None, row: str = "row") -> None:
    """Raise unless ``got`` equals ``want`` exactly (same shape, every element; NaN equals NaN); the message names
    the rows (first dimension) that differ and what they share."""
    got_t, want_t = torch.as_tensor(got).detach().cpu(), torch.as_tensor(want).detach().cpu()
    if got_t.shape != want_t.shape:
        raise AssertionError(f"{name}: shape {list(got_t.shape)}, expected {list(want_t.shape)}")
    if got_t.dtype != want_t.dtype:
        got_t, want_t = got_t.double(), want_t.double()
    if got_t.ndim == 0:
        got_t, want_t = got_t[None], want_t[None]
    same = (got_t == want_t) | (got_t.isnan() & want_t.isnan() if got_t.is_floating_point() else False)
    bad = ~same.reshape(same.shape[0], -1).all(dim=1)
    if not bad.any():
        return
    explained = describe(bad, facts)
    raise AssertionError(f"{name}: {row_list(bad, row)} differ" + (f"; {explained}" if explained else ""))


def assert_rows(name: str, bad, what: str, *, facts: Mapping[str, object] | None = None, row: str = "token") -> None:
    """Raise when ``bad`` [N] is True anywhere: ``"<name>: tokens 3, 17 (2 of 16) <what>; <facts>"``."""
    bad = _bool(bad)
    if not bad.any():
        return
    explained = describe(bad, facts)
    raise AssertionError(f"{name}: {row_list(bad, row)} {what}" + (f"; {explained}" if explained else ""))

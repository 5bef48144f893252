"""The report: one line per measured row while the run goes, and markdown tables of the whole run (what
BENCHMARKS.md quotes), plus :func:`failures`, the rows that make the CLI exit non-zero."""

from __future__ import annotations

from moelab.roofline import si


def format_row(row: dict) -> str:
    tag = f"[{row['mode']} {row['shape']} {row['routing']}]"
    var = f" ({row['variant']})" if row.get("variant", "none") != "none" else ""
    head = f"{tag} T={row['T']:>6} {row['impl'] + var:<44}"
    if "skipped" in row:
        return f"{head} skipped: {row['skipped']}"
    if "error" in row and "median_us" not in row:
        chk = f" (check {row['check']} {row['rel_err']:.1e})" if "check" in row else ""
        return f"{head} ERROR{chk}: {row['error']}"
    vs = f" vs moelab {row['vs_moelab_triton']:5.2f}x" if "vs_moelab_triton" in row else ""
    if "base_rows_bitwise" in row:
        vs += f"  -1 rows bitwise={'yes' if row['base_rows_bitwise'] else 'NO'}"
    peak = f"  peak {row['peak_bytes'] / 2**20:.1f} MiB" if "peak_bytes" in row else ""
    return (f"{head} {row['median_us']:10.1f} us  floor {row['floor_us']:8.1f} us ({row['bound']:<7})"
            f" x{row['x_floor']:6.2f} floor{vs}{peak}  err {row['rel_err']:.1e} {row['check']}")


def failures(results: dict) -> list[str]:
    """Why the run failed, one line per row: an error, a failed check against the float64 reference, or tokens
    without an adapter that are not bit for bit the base path's output. Empty when every row passed."""
    out = list(results.get("errors", []))
    for r in results.get("rows", []):
        what = f"{r['mode']} {r['shape']} {r['routing']} T={r['T']} {r['impl']}" + \
            (f" ({r['variant']})" if r.get("variant", "none") != "none" else "")
        if "error" in r:
            out.append(f"{what}: error: {r['error']}")
        if r.get("check") == "FAIL":
            out.append(f"{what}: check failed: rel err {r['rel_err']:.2e} (tolerance {r.get('tol', '?')})"
                       + ("" if r.get("all_finite", True) else ", output not finite"))
        if r.get("base_rows_bitwise") is False:
            out.append(f"{what}: tokens with lora_id -1 differ from the base path's output")
    return out


def _fmt(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "-"
    if v >= 10**6:
        return f"{v:.3g}"
    return f"{v:.{max(digits, 1) if v < 10 else digits}f}"


#: The tables of each (mode, shape, routing): title, row key, digits, scale.
_TABLES = (("median µs", "median_us", 0, 1), ("measured / floor", "x_floor", 2, 1),
           ("time / moelab triton ([graph] rows: / moelab triton [graph])", "vs_moelab_triton", 2, 1),
           ("peak MiB allocated by one eager call (output included)", "peak_bytes", 1, 2**-20))


def _pivot(mode: str, shape: str, routing: str, rs: list[dict]) -> list[str]:
    """The T x implementation tables of one (mode, shape, routing). LoRA mode indexes rows by (T, variant) and
    repeats the base layer ("moelab triton", no LoRA) in each row as the reference column."""
    lora = mode == "lora"
    cols: list[str] = []
    for r in rs:
        if r["impl"] not in cols:
            cols.append(r["impl"])
    variants = []
    for r in rs:
        if r.get("variant", "none") not in variants and (r.get("variant", "none") != "none" or not lora):
            variants.append(r.get("variant", "none"))
    cell = {(r["T"], r.get("variant", "none"), r["impl"]): r for r in rs}
    floors = {(r["T"], r.get("variant", "none")): r for r in rs if "floor_us" in r}
    lines = []
    for title, key, digits, scale in _TABLES:
        if key == "peak_bytes" and not any(key in r for r in rs):
            continue  # no peak memory off CUDA
        title = title.replace("moelab triton", "moelab triton (no LoRA)", 1) if lora else title
        head = "| T | " + ("LoRA | " if lora else "") + "touched | floor µs | " + " | ".join(cols) + " |"
        lines += ["", f"**{mode}: {shape}, {routing} routing, bf16: {title}**", "", head,
                  "|" + "---|" * (head.count("|") - 1)]
        for T in sorted({r["T"] for r in rs}):
            for v in variants:
                if not any((T, v, c) in cell for c in cols):
                    continue
                vals = []
                for col in cols:
                    r = cell.get((T, v, col)) or (cell.get((T, "none", col)) if lora else None)
                    if r is None:
                        vals.append("")
                    elif key in r:
                        vals.append(_fmt(r[key] * scale, digits) + (" ✗" if r.get("check") == "FAIL" else ""))
                    elif "median_us" in r:
                        vals.append("-")
                    else:
                        vals.append("err" if "error" in r else "skip")
                f = floors.get((T, v)) or floors.get((T, "none"), {})
                touched = f.get("touched_experts")
                lines.append(f"| {T} | " + (f"{v} | " if lora else "")
                             + f"{_fmt(touched, 1) if touched is not None else ''} | {_fmt(f.get('floor_us'))} | "
                             + " | ".join(vals) + " |")
    return lines


def _eager_over_graph(mode: str, shape: str, routing: str, rs: list[dict]) -> list[str]:
    """Eager time over CUDA-graph time of each implementation measured both ways (what the host adds to a
    call), by (T, variant); nothing when no graph rows were measured."""
    us = {(r["T"], r.get("variant", "none"), r["impl"]): r["median_us"] for r in rs if "median_us" in r}
    pairs = sorted({(T, v, impl[: -len(" [graph]")]) for T, v, impl in us if impl.endswith(" [graph]")
                    and (T, v, impl[: -len(" [graph]")]) in us})
    if not pairs:
        return []
    cols = list(dict.fromkeys(impl for _, _, impl in pairs))
    head = "| T | " + ("LoRA | " if mode == "lora" else "") + " | ".join(cols) + " |"
    lines = ["", f"**{mode}: {shape}, {routing} routing, bf16: eager / [graph] time**", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for T, v in dict.fromkeys((T, v) for T, v, _ in pairs):
        vals = [_fmt(us[(T, v, c)] / us[(T, v, c + " [graph]")], 2) if (T, v, c) in us
                and (T, v, c + " [graph]") in us else "" for c in cols]
        lines.append(f"| {T} | " + (f"{v} | " if mode == "lora" else "") + " | ".join(vals) + " |")
    b2b = {(r["T"], r.get("variant", "none"), r["impl"]): r["back_to_back_us"] for r in rs if "back_to_back_us" in r}
    b2b_pairs = [(T, v, c) for T, v, c in pairs if (T, v, c) in b2b and (T, v, c + " [graph]") in b2b]
    if b2b_pairs:  # the same calls one after another, one synchronize per round (roofline.back_to_back_us)
        head = "| T | " + ("LoRA | " if mode == "lora" else "") + "impl | eager µs | [graph] µs | eager / [graph] |"
        lines += ["", f"**{mode}: {shape}, {routing} routing, bf16: eager / [graph] time, calls back to back**", "",
                  head, "|" + "---|" * (head.count("|") - 1)]
        for T, v, c in b2b_pairs:
            e, g = b2b[(T, v, c)], b2b[(T, v, c + " [graph]")]
            lines.append(f"| {T} | " + (f"{v} | " if mode == "lora" else "") + f"{c} | {_fmt(e, 1)} | {_fmt(g, 1)} | "
                         f"{_fmt(e / g, 2)} |")
    return lines


def markdown(results: dict) -> str:
    """Markdown tables of ``results`` (from :func:`moelab.bench.run`), ready to paste into BENCHMARKS.md."""
    env, c = results.get("env", {}), results.get("ceilings", {})
    lines = [f"GPU: {env.get('device', '?')} · torch {env.get('torch')} · triton {env.get('triton')} · "
             f"transformers {env.get('transformers')} · peft {env.get('peft')} · liger-kernel {env.get('liger_kernel')}"
             f" · moelab commit {env.get('commit')}",
             f"Command: `{results.get('command', '')}`"]
    if env.get("switches"):  # the kernels this process could pick (the GPU decides the rest)
        lines.append("Kernel switches: " + ", ".join(f"{k}={v if isinstance(v, str) else int(v)}"
                                                   for k, v in env["switches"].items()))
    if env.get("tile_table"):
        lines.append(f"Tile table: {env['tile_table']}")
    if c:
        where = "Ceilings in the same run" if c.get("copy_bytes") else f"Ceilings not measured ({c.get('device')})"
        timer = "triton.testing.do_bench" if env.get("device", "CPU") != "CPU" else "time.perf_counter"
        checked = results.get("config", {}).get("check_tokens")
        lines.append(f"{where}: copy {si(c['bandwidth'], 'B/s')}, {c.get('dtype', 'bf16')} "
                     f"matmul {si(c['matmul_flops'], 'FLOP/s')}. floor = max((touched experts' weights + "
                     f"activations) / copy BW, 6·T·K·H·I FLOPs / matmul rate); µs are medians of {timer}, "
                     f"rotating {results.get('config', {}).get('sets')} input sets. Every output is checked against "
                     f"the float64 reference (moelab.reference) on {checked} of its tokens (all when T <= {checked}) "
                     f"before it is timed; ✗ marks a failed check.")
    rows = [r for r in results.get("rows", []) if r["mode"] != "ops"]
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["shape"], r["routing"]), []).append(r)
    for (mode, shape, routing), rs in groups.items():
        lines += _pivot(mode, shape, routing, rs) + _eager_over_graph(mode, shape, routing, rs)
    ops = [r for r in results.get("rows", []) if r["mode"] == "ops"]
    if ops:
        lines += ["", "**ops (bytes read + written)**", "", "| op | T | µs | GB/s | % of copy BW |",
                  "|---|---|---|---|---|"]
        for r in ops:
            if "median_us" in r:
                lines.append(f"| {r['impl']} | {r['T']} | {r['median_us']:.1f} | {r['GB_s']:.0f} | "
                             f"{100 * r['frac_copy_bw']:.1f} |")
            else:
                lines.append(f"| {r['impl']} | {r['T']} | {r.get('skipped') or r.get('error')} | | |")
    notes = sorted({f"{r['impl']}: {r.get('skipped') or r.get('error')}" for r in results.get("rows", [])
                    if ("skipped" in r or "error" in r) and "median_us" not in r})
    if notes:
        lines += ["", "Not measured:"] + [f"- {n}" for n in notes]
    bitwise = [r for r in rows if "base_rows_bitwise" in r]
    if bitwise:
        lines += ["", "Tokens with lora_id -1 bit for bit equal to the base path's output: " + ", ".join(
            f"{r['impl']} ({r['variant']}) T={r['T']}: {'yes' if r['base_rows_bitwise'] else 'NO'}"
            for r in bitwise)]
    fails = [r for r in rows if r.get("check") == "FAIL"]
    if fails:
        lines += ["", "✗ = correctness check failed (rel err above tolerance, or a non-finite output):"]
        lines += [f"- {r['impl']} ({r.get('variant')}) T={r['T']}: {r['rel_err']:.2e}" for r in fails]
    return "\n".join(lines) + "\n"

"""The runner: inputs, the float64 check of every row against ``moelab.reference``, timing, peak memory, and the
plans (which implementations run for each shape, routing and T)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

import moelab
from moelab import reference
from moelab.bench import impls, peers
from moelab.bench.impls import Skip
from moelab.bench.report import format_row, markdown
from moelab.lab import rel_err
from moelab.roofline import Ceilings, Shape, back_to_back_us, median_us, roofline

#: Tolerances of ``||out - ref|| / ||ref||`` against the float64 reference, bf16 layer: moelab's own rows and
#: the peers (which round differently, e.g. HF's bf16 SwiGLU).
MOELAB_TOL, PEER_TOL = 1e-2, 2e-2
#: Ranks of a mixed bank's slots, slot i has ``MIXED_RANKS[i % 4]``.
MIXED_RANKS = (64, 32, 16, 8)
#: Host memory (bytes) for the float64 expert weights of one reference call; the checked tokens go in chunks.
_REFERENCE_BYTES = 4 << 30


# ---------------------------------------------------------------------------------------------- inputs

@dataclass
class InputSet:
    """One set of inputs of one T: hidden states, routing, and (LoRA) adapter ids per variant."""

    x: torch.Tensor  # [T, H]
    ids: torch.Tensor  # int32 [T, K]
    ids64: torch.Tensor  # int64 [T, K] (HF's one_hot wants int64)
    weights: torch.Tensor  # [T, K] routing weights rounded to bf16 (the x dtype): every impl gets these
    packed: torch.Tensor  # int32 [T, K] FlashInfer routing words
    lora_ids: dict[str, torch.Tensor] = field(default_factory=dict)  # variant -> int32 [T]


def _routing(T: int, shape: Shape, routing: str, zipf_s: float, device) -> torch.Tensor:
    E, K = shape.E, shape.K
    if routing == "uniform":
        return torch.rand(T, E, device=device).topk(K, dim=1).indices.to(torch.int32)
    if routing == "zipf":  # expert popularity ~ 1/rank^s, ranks shuffled; K distinct experts per token
        p = 1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float32) ** zipf_s
        p = p[torch.randperm(E, device=device)]
        return torch.multinomial(p.expand(T, E).contiguous(), K, replacement=False).to(torch.int32)
    raise ValueError(f"routing: expected 'uniform' or 'zipf', got {routing!r}")


def make_set(T: int, shape: Shape, routing: str, zipf_s: float, dtype, device) -> InputSet:
    x = torch.randn(T, shape.H, dtype=dtype, device=device)
    ids = _routing(T, shape, routing, zipf_s, device)
    w = torch.softmax(torch.randn(T, shape.K, device=device), dim=1).to(dtype)
    return InputSet(x, ids, ids.long(), w, moelab.pack_topk_ids_weights(ids, w, validate=False))


# ---------------------------------------------------------------------------------------------- LoRA variants

@dataclass(frozen=True)
class LoRAVariant:
    """``"Nx all"``: every token has one of N adapters; ``"Nx half"``: half of the tokens have -1; ``"mixed"``:
    the N adapters have ranks 64, 32, 16, 8, 64, ... (a serving bank) instead of ``--rank``."""

    name: str
    adapters: int
    live: float
    mixed: bool

    def ranks(self, rank: int) -> list[int]:
        return [MIXED_RANKS[i % len(MIXED_RANKS)] if self.mixed else rank for i in range(self.adapters)]


def parse_variants(text: str, adapters: str) -> list[LoRAVariant]:
    """``--lora-variants`` (e.g. ``"1x all,4x half,8x mixed,32x mixed"``), or 'Nx all' and 'Nx half' for each N
    of ``--adapters`` when it is empty."""
    items = [" ".join(v.split()) for v in text.split(",") if v.strip()] if text else \
        [f"{n}x {h}" for n in adapters.split(",") if n.strip() for h in ("all", "half")]
    out = []
    for item in items:
        n, _, rest = item.partition("x ")
        words = rest.split()
        if not n.isdigit() or int(n) < 1 or not words or not set(words) <= {"all", "half", "mixed"} \
                or {"all", "half"} <= set(words) or len(set(words)) != len(words):
            raise ValueError(f"--lora-variants: expected items like '1x all', '4x half', '8x mixed' or "
                             f"'32x mixed half' (N >= 1 adapters), got {item!r}")
        out.append(LoRAVariant(item, int(n), 0.5 if "half" in words else 1.0, "mixed" in words))
    return out


def _lora_ids(T: int, v: LoRAVariant, device) -> torch.Tensor:
    """int32 [T]: each token one of ``v.adapters`` slots, uniformly; a ``1 - v.live`` share of them -1."""
    ids = torch.randint(0, v.adapters, (T,), device=device, dtype=torch.int32)
    n_live = math.ceil(T * v.live)
    if n_live < T:
        ids[torch.randperm(T, device=device)[n_live:]] = -1
    return ids


# ---------------------------------------------------------------------------------------------- context

@dataclass
class Ctx:
    """What every implementation builder gets: the shape, the HF-order weights, the LoRA banks."""

    shape: Shape
    w13: torch.Tensor  # [E, 2I, H] rows [gate; up]
    w2: torch.Tensor  # [E, H, I]
    device: torch.device
    dtype: torch.dtype
    args: argparse.Namespace
    banks: dict = field(default_factory=dict)  # variant name -> moelab.LoRABank ("ids=-1": the first one)
    #: the experts' activation and biases, as prepare_weights takes them (--activation, --bias); empty: SwiGLU
    expert: dict = field(default_factory=dict)

    def bank_of(self, variant: str) -> moelab.LoRABank:
        return self.banks[variant]


def _make_banks(ctx: Ctx, variants: list[LoRAVariant], rank: int) -> None:
    """The '--rank' variants share one bank with as many slots as the widest of them (a serving engine's fixed
    ``max_loras``); each mixed variant gets its own bank of exactly its N slots."""
    uniform = [v for v in variants if not v.mixed]
    if uniform:
        bank = impls.make_bank(ctx, [rank] * max(v.adapters for v in uniform))
        ctx.banks.update({v.name: bank for v in uniform})
    for v in variants:
        if v.mixed:
            ctx.banks[v.name] = impls.make_bank(ctx, v.ranks(rank))
    ctx.banks["ids=-1"] = ctx.banks[variants[0].name]


# ---------------------------------------------------------------------------------------------- the float64 check

def check_rows(T: int, n: int, device) -> torch.Tensor:
    """int64 [min(T, n)] tokens whose outputs are checked: all of them when T <= n, else the first, the last and
    random others (sorted; only the first when n is 1)."""
    if T <= n:
        return torch.arange(T, device=device)
    if n == 1:
        return torch.zeros(1, dtype=torch.int64, device=device)
    inner = torch.randperm(T - 2, device=device)[: max(n - 2, 0)] + 1
    return torch.cat([torch.tensor([0, T - 1], device=device), inner]).sort().values


def _f64(t: torch.Tensor) -> torch.Tensor:
    """float64 on the CPU, widened where ``t`` is (exact; on a GPU faster than widening on the host)."""
    return t.to(torch.float64).cpu()


def reference_rows(ctx: Ctx, s: InputSet, rows: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """float64 CPU [len(rows), H]: ``moelab.reference.routed_moe`` (or ``lora_experts`` with the ``variant``'s
    adapters) of the tokens ``rows``. Each call gets only the experts and adapters its tokens touch (as local ids),
    in chunks of tokens whose float64 weights fit in a few GiB of host memory."""
    K, H, I = ctx.shape.K, ctx.shape.H, ctx.shape.I
    chunk = max(1, _REFERENCE_BYTES // (K * 3 * H * I * 8))  # float64 gate, up, down of K experts a token
    if variant is not None:  # c tokens take up to c adapters x c*K experts of the bank
        per_pair = 3 * ctx.bank_of(variant).max_rank * (H + I) * 8
        chunk = min(chunk, max(1, math.isqrt(_REFERENCE_BYTES // (K * per_pair))))
    out = []
    for part in rows.split(chunk):
        ids = s.ids[part]
        experts, local = torch.unique(ids, return_inverse=True)
        w13, w2, x, w = (_f64(t) for t in (ctx.w13[experts], ctx.w2[experts], s.x[part], s.weights[part]))
        if variant is None:
            expert = {k: _f64(v[experts]) if isinstance(v, torch.Tensor) else v for k, v in ctx.expert.items()}
            out.append(reference.routed_moe(local.cpu(), w, x, w13, w2, **expert)["output"])
            continue
        bank, lora = ctx.bank_of(variant), s.lora_ids[variant][part].long()
        slots = torch.unique(lora[lora >= 0])
        lora_local = torch.where(lora >= 0, torch.searchsorted(slots, lora.clamp(min=0)), -1)
        sub = SimpleNamespace(**{name: _f64(getattr(bank, name)[slots][:, experts]) for name in
                                 ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b")})
        out.append(reference.lora_experts(x, w, local.cpu(), lora_local.cpu(), w13, w2, sub)["output"])
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------- runner

@dataclass
class Impl:
    name: str
    build: Callable[[], Callable[[InputSet], torch.Tensor]]
    moelab: bool = False  # moelab's own: tolerance MOELAB_TOL, peers PEER_TOL
    graph: bool = False  # also time a CUDA-graph capture of it
    variant: str = "none"
    peer: str = ""  # the --peers key that selects it ("": moelab's main rows, always run)


class Runner:
    def __init__(self, args: argparse.Namespace, device: torch.device, ceilings: Ceilings, results: dict):
        self.args, self.device, self.ceilings, self.results = args, device, ceilings, results
        self.t0 = time.monotonic()
        self._built: dict[tuple, object] = {}

    # -- bookkeeping
    def over_budget(self) -> bool:
        b = self.args.time_budget
        return b is not None and time.monotonic() - self.t0 > b

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.results["markdown"] = markdown(self.results)
        out = self.args.out
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(self.results, f, indent=1, default=str)
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(self.results["markdown"])

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def fn_of(self, impl: Impl):
        key = (impl.name, impl.variant)
        if key not in self._built:
            try:
                self._built[key] = impl.build()
            except Skip as e:
                self._built[key] = Skip(str(e))
        return self._built[key]

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _graphs(self, fn, sets):
        """One CUDA graph per input set; returns (replay callables, static outputs)."""
        replays, outs = [], []
        for s in sets:
            fn(s)  # warm (compiles, caches) outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = fn(s)
            replays.append(g.replay)
            outs.append(out)
        return replays, outs

    def _peak_bytes(self, fn, s: InputSet) -> int | None:
        """Bytes allocated at the peak of one eager call beyond what was allocated before it (output included);
        None off CUDA."""
        if self.device.type != "cuda":
            return None
        self._sync()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        out = fn(s)
        self._sync()
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del out
        return int(peak)

    # -- one measurement
    def measure(self, impl: Impl, sets: list[InputSet], check: dict, base: dict, *, graph: bool = False):
        """Check ``impl`` on set 0 against the float64 reference of the tokens ``check["rows"]``, then time it
        rotating the sets (and record its peak memory); a failure becomes the row's ``error``."""
        a = self.args
        name = impl.name + (" [graph]" if graph else "")
        T = sets[0].x.shape[0]
        row = {"mode": base["mode"], "shape": base["shape"], "routing": base["routing"], "impl": name,
               "variant": impl.variant, "T": T, "touched_experts": base["touched"],
               "floor_us": base["roof"]["floor_us"], "bound": base["roof"]["bound"]}
        if impl.variant in base.get("lora_roof", {}):
            roof = base["lora_roof"][impl.variant]
            row.update(floor_us=roof["floor_us"], bound=roof["bound"], lora_pairs=roof["pairs"])
        if self.over_budget():
            row["skipped"] = "time budget spent"
            return self._emit(row, quiet=True)
        fn = self.fn_of(impl)
        if isinstance(fn, Skip):
            row["skipped"] = str(fn)
            return self._emit(row)
        try:
            if graph:
                replays, outs = self._graphs(fn, sets)
                replays[0]()
                self._sync()
                out0 = outs[0]
                cyc = itertools.cycle(replays)
                timed = lambda: next(cyc)()
            else:
                out0 = fn(sets[0])
                self._sync()
                cyc = itertools.cycle(sets)
                timed = lambda: fn(next(cyc))
            tol = MOELAB_TOL if impl.moelab else PEER_TOL
            if tuple(out0.shape) != tuple(sets[0].x.shape):
                raise ValueError(f"output shape {tuple(out0.shape)}, expected {tuple(sets[0].x.shape)}")
            err = rel_err(out0[check["rows"]], check["ref"][impl.variant])
            finite = bool(torch.isfinite(out0).all())
            row.update(rel_err=err, tol=tol, checked_tokens=len(check["rows"]), all_finite=finite,
                       check="ok" if err < tol and finite else "FAIL")
            lora_ids = sets[0].lora_ids.get(impl.variant)
            base_fn = getattr(fn, "base", None)  # the call without adapters, in the same mode (eager or graph)
            if impl.moelab and lora_ids is not None and base_fn is not None and bool((lora_ids < 0).any()):
                if graph:
                    base_replays, base_outs = self._graphs(base_fn, sets[:1])
                    base_replays[0]()
                    self._sync()
                    base_out = base_outs[0].clone()
                    del base_replays, base_outs  # the base graph and its memory pool go before the timing
                else:
                    base_out = base_fn(sets[0])
                keep = lora_ids < 0  # tokens without an adapter: bit for bit the base call's output
                row["base_rows_bitwise"] = bool(torch.equal(out0[keep], base_out[keep]))
                del base_out
            del out0
            if not graph:
                peak = self._peak_bytes(fn, sets[-1])
                if peak is not None:
                    row["peak_bytes"] = peak
            row["median_us"] = median_us(timed, self.device, warmup_ms=a.warmup_ms, rep_ms=a.rep_ms,
                                         cpu_reps=a.cpu_reps, cpu_warmup=0)  # the checked call warmed it
            row["x_floor"] = row["median_us"] / row["floor_us"]
            if impl.moelab and self.device.type == "cuda" and T <= a.graph_max_t:  # the host's share, unhidden
                row["back_to_back_us"] = back_to_back_us(timed, self.device)
        except Skip as e:  # this input is outside what the implementation takes (e.g. a forced LoRA path)
            row["skipped"] = str(e)
        except Exception as e:  # one broken peer must not lose the run; the CLI exits non-zero for it
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            if a.verbose:
                traceback.print_exc()
        return self._emit(row)

    def _emit(self, row: dict, quiet: bool = False) -> dict:
        """Record ``row`` (with its time over moelab triton's of the same T: graph rows over moelab triton
        [graph], eager rows over the eager call), print it, save the results."""
        self.results["rows"].append(row)
        graph = row["impl"].endswith(" [graph]")
        ref_rows = [r for r in self.results["rows"] if r["mode"] == row["mode"] and r["shape"] == row["shape"]
                    and r["routing"] == row["routing"] and r["T"] == row["T"] and "median_us" in r
                    and r["impl"] == ("moelab triton [graph]" if graph else "moelab triton")]
        if "median_us" in row and ref_rows:
            row["vs_moelab_triton"] = row["median_us"] / ref_rows[0]["median_us"]
        if not quiet:
            self.log(format_row(row))
        self.save()
        return row


# ---------------------------------------------------------------------------------------------- plans

#: ``--peers`` keys: base mode, then LoRA mode; groups of keys.
BASE_PEERS = ("torch", "naive", "grouped_mm", "hf-eager", "hf-grouped_mm", "liger")
LORA_PEERS = ("lora-ops", "unfused", "peft")
PEER_GROUPS = {"all": BASE_PEERS + LORA_PEERS, "none": (), "hf": ("hf-eager", "hf-grouped_mm")}


def parse_peers(text: str) -> set[str]:
    """``--peers``: comma list of keys of :data:`BASE_PEERS` and :data:`LORA_PEERS`, or "all", "none", "hf"."""
    keys: set[str] = set()
    for word in (w.strip().lower() for w in text.split(",") if w.strip()):
        if word in PEER_GROUPS:
            keys |= set(PEER_GROUPS[word])
        elif word in BASE_PEERS + LORA_PEERS:
            keys.add(word)
        else:
            raise ValueError(f"--peers: expected a comma list of {list(BASE_PEERS + LORA_PEERS)} or "
                             f"{list(PEER_GROUPS)}, got {word!r}")
    return keys


def _base_impls(ctx: Ctx) -> list[Impl]:
    cuda = ctx.device.type == "cuda"
    out = [Impl("moelab triton", lambda: impls.build_moelab(ctx, "triton"), moelab=True, graph=cuda)]
    if cuda and "flashinfer" in moelab.available_backends(ctx.device):
        out.append(Impl("moelab flashinfer", lambda: impls.build_moelab(ctx, "flashinfer"), moelab=True))
    return out + [
        Impl("moelab torch", lambda: impls.build_moelab(ctx, "torch"), moelab=True, peer="torch"),
        Impl("naive loop", lambda: peers.build_naive(ctx), peer="naive"),
        Impl("torch grouped_mm", lambda: peers.build_grouped_mm(ctx), graph=cuda, peer="grouped_mm"),
        Impl("HF eager", lambda: peers.build_hf(ctx, "eager"), peer="hf-eager"),
        Impl("HF grouped_mm", lambda: peers.build_hf(ctx, "grouped_mm"), peer="hf-grouped_mm"),
        Impl("Liger fused MoE", lambda: peers.build_liger(ctx), peer="liger")]


def _lora_impls(ctx: Ctx, variants: list[LoRAVariant]) -> list[Impl]:
    cuda = ctx.device.type == "cuda"
    out = [Impl("moelab triton", lambda: impls.build_moelab(ctx, "triton"), moelab=True, graph=cuda),
           Impl("moelab LoRAExperts", lambda: impls.build_lora_experts(ctx, "ids=-1"), moelab=True, graph=cuda,
                variant="ids=-1")]
    for v in (v.name for v in variants):
        out += [Impl("moelab LoRAExperts" + (f" [{p}]" if p != "auto" else ""),
                     lambda v=v, p=p: impls.build_lora_experts(ctx, v, None if p == "auto" else p), moelab=True,
                     graph=cuda, variant=v) for p in ctx.args.lora_paths.split(",")]
        out += [
                Impl("moelab LoRA ops", lambda v=v: impls.build_lora_ops(ctx, v), moelab=True, graph=cuda,
                     variant=v, peer="lora-ops"),
                Impl("unfused LoRA (grouped_mm)", lambda v=v: peers.build_unfused_lora(ctx, v), variant=v,
                     peer="unfused"),
                Impl("HF grouped_mm + PEFT", lambda v=v: peers.build_peft(ctx, v), variant=v, peer="peft")]
    return out


def _keep(impl: Impl, args) -> bool:
    if impl.peer and impl.peer not in args.peer_keys:
        return False
    if not args.impls:
        return True
    words = [w.strip().lower() for w in args.impls.split(",") if w.strip()]
    return any(w in impl.name.lower() for w in words)


def _ints(text: str) -> list[int]:
    return [int(v) for v in str(text).split(",") if v.strip()]


def _record_all(runner: Runner, impls_: list[Impl], where: dict, **what) -> None:
    for impl in impls_:
        runner._emit(dict(where, impl=impl.name, variant=impl.variant, **what), quiet=True)


def run_shape(runner: Runner, shape: Shape, routing: str, mode: str) -> None:
    """Every T of ``--tokens`` for one shape and routing, ``mode`` "base" or "lora"."""
    a, device, dtype = runner.args, runner.device, torch.bfloat16
    torch.manual_seed(a.seed)
    E, H, I = shape.E, shape.H, shape.I
    w13 = (torch.randn(E, 2 * I, H, device=device) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, I, device=device) / math.sqrt(I)).to(dtype)
    ctx = Ctx(shape, w13, w2, device, dtype, a)
    if mode == "base" and a.activation != "silu":
        ctx.expert["activation"] = a.activation
    if mode == "base" and a.bias:
        ctx.expert["w13_bias"] = (torch.randn(E, 2 * I, device=device) * 0.1).to(dtype)
        ctx.expert["w2_bias"] = (torch.randn(E, H, device=device) * 0.1).to(dtype)
    variants = []
    if mode == "lora":
        variants = parse_variants(a.lora_variants, a.adapters)
        _make_banks(ctx, variants, a.rank)
        plan = _lora_impls(ctx, variants)
    else:
        plan = _base_impls(ctx)
    plan = [i for i in plan if _keep(i, a)]
    runner._built.clear()
    runner.log(f"== {mode}: {shape}, {routing} routing, bf16, T = {a.tokens}, {a.sets} input sets"
               + (f", experts: {a.activation}{' with biases' if a.bias else ''}" if ctx.expert else "")
               + (f", LoRA variants {[v.name for v in variants]} (rank {a.rank} unless mixed)" if variants else ""))
    for T in _ints(a.tokens):
        where = {"mode": mode, "shape": shape.name, "routing": routing, "T": T}
        if runner.over_budget():
            runner.log(f"[{mode} {shape.name} {routing}] T={T}: time budget {a.time_budget} s spent, skipped")
            _record_all(runner, plan, where, skipped="time budget spent")
            continue
        try:
            _run_tokens(runner, ctx, plan, variants, T, routing, mode)
        except Exception as e:  # inputs or reference failed (e.g. out of memory): record it, go on with next T
            runner.log(f"[{mode} {shape.name} {routing}] T={T}: {type(e).__name__}: {e}")
            _record_all(runner, plan, where, error=f"setup: {type(e).__name__}: {e}")
            if a.verbose:
                traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del ctx
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _lora_roof(runner: Runner, shape: Shape, T: int, touched: float, sets: list[InputSet], v: str, ranks):
    """The LoRA roofline of variant ``v``: touched (adapter, expert) pairs and the ranks of pairs and slots."""
    pair_ranks, slot_ranks, n_pairs, n_slots = [], [], [], []
    for s in sets:
        lora = s.lora_ids[v].long()[:, None].expand_as(s.ids64)
        live = lora >= 0
        pairs = torch.unique((lora * shape.E + s.ids64)[live])
        n_pairs.append(len(pairs))
        pair_ranks.append(float(ranks[(pairs // shape.E).cpu()].sum()))
        n_slots.append(int(live.sum()))
        slot_ranks.append(float(ranks[lora[live].cpu()].sum()))
    pairs, slots = statistics.mean(n_pairs), statistics.mean(n_slots)
    pair_rank = statistics.mean(pair_ranks) / pairs if pairs else 0.0
    slot_rank = statistics.mean(slot_ranks) / slots if slots else 0.0
    roof = roofline(shape, T, touched_experts=touched, ceilings=runner.ceilings, lora_rank=pair_rank,
                    lora_pairs=pairs, lora_slots=slots, lora_slot_rank=slot_rank)
    return dict(roof, pairs=pairs)


def _run_tokens(runner: Runner, ctx: Ctx, plan: list[Impl], variants: list[LoRAVariant], T: int, routing: str,
                mode: str) -> None:
    a, device, dtype, shape = runner.args, ctx.device, ctx.dtype, ctx.shape
    torch.manual_seed(a.seed + T)
    t_ref = time.monotonic()
    sets = [make_set(T, shape, routing, a.zipf_s, dtype, device) for _ in range(a.sets)]
    touched = statistics.mean(len(torch.unique(s.ids)) for s in sets)
    base = {"mode": mode, "shape": shape.name, "routing": routing, "touched": touched,
            "roof": roofline(shape, T, touched_experts=touched, ceilings=runner.ceilings)}
    rows = check_rows(T, a.check_tokens, device)
    check = {"rows": rows, "ref": {"none": reference_rows(ctx, sets[0], rows)}}
    if mode == "lora":
        base["lora_roof"] = {}
        check["ref"]["ids=-1"] = check["ref"]["none"]
        for s in sets:
            s.lora_ids["ids=-1"] = torch.full((T,), -1, dtype=torch.int32, device=device)
        for v in variants:
            for s in sets:
                s.lora_ids[v.name] = _lora_ids(T, v, device)
            ranks = torch.tensor(ctx.bank_of(v.name).ranks, dtype=torch.float64)
            base["lora_roof"][v.name] = _lora_roof(runner, shape, T, touched, sets, v.name, ranks)
            check["ref"][v.name] = reference_rows(ctx, sets[0], rows, v.name)
    runner.log(f"[{mode} {shape.name} {routing}] T={T}: {touched:.1f} experts touched, floor "
               f"{base['roof']['floor_us']:.1f} us ({base['roof']['bound']}), inputs + float64 reference of "
               f"{len(rows)} tokens in {time.monotonic() - t_ref:.1f} s, {time.monotonic() - runner.t0:.0f} s elapsed")
    for impl in plan:
        runner.measure(impl, sets, check, base)
        if impl.graph and a.graphs and T <= a.graph_max_t:
            runner.measure(impl, sets, check, base, graph=True)


def run_ops(runner: Runner, shape: Shape) -> None:
    """unpermute_activation and finalize_with_w2_lora (Triton and torch fallback) at --ops-tokens as achieved GB/s
    (bytes read + written), each checked against ``moelab.reference`` on the checked tokens."""
    a, device, dtype = runner.args, runner.device, torch.bfloat16
    T = a.ops_tokens
    E, K, H, I = shape.E, shape.K, shape.H, shape.I
    torch.manual_seed(a.seed)
    runner.log(f"== ops: {shape}, T={T}, bf16")
    try:
        w13 = (torch.randn(E, 2 * I, H, device=device) / math.sqrt(H)).to(dtype)
        w2 = (torch.randn(E, H, I, device=device) / math.sqrt(I)).to(dtype)
        W = moelab.prepare_weights(w13, w2, backend="triton")
        s = make_set(T, shape, "uniform", a.zipf_s, dtype, device)
        delta = torch.randn(T, K, 2 * I, device=device, dtype=dtype) * 0.1
        gemm2, ew, e2p, act = moelab.routed_moe(s.packed, s.x, W, num_experts=E, top_k=K, gemm1_lora_delta=delta,
                                                do_finalize=False, validate=False)
        w2_delta = torch.randn(T, K, H, device=device, dtype=dtype) * 0.1
        out = torch.empty(T, H, device=device, dtype=dtype)
        del w13, w2, W
        # The reference of the checked tokens: their map entries, and the permuted rows they name as rows 0..n*K-1.
        rows = check_rows(T, a.check_tokens, device)
        e2p_rows = e2p.view(T, K)[rows].flatten()
        local_map = torch.where(e2p_rows >= 0, torch.arange(len(e2p_rows), device=device), -1).cpu()
        picked = e2p_rows.clamp(min=0).long()
        ref_act = reference.unpermute_activation(act[picked], local_map, len(rows), K)
        ref_fin = {d: reference.finalize_with_w2_lora(gemm2[picked], ew.view(T, K)[rows], local_map,
                                                      (w2_delta if d else torch.zeros_like(w2_delta))[rows])
                   for d in (True, False)}
    except Exception as e:
        runner.log(f"ops: could not build inputs: {type(e).__name__}: {e}")
        runner.results["rows"].append({"mode": "ops", "shape": shape.name, "routing": "uniform", "T": T,
                                       "impl": "ops inputs", "variant": "none", "error": f"{type(e).__name__}: {e}"})
        return
    b = dtype.itemsize
    live = int((e2p >= 0).sum())
    rows_k = (rows[:, None] * K + torch.arange(K, device=device)).flatten()
    cases = []
    for use_triton in (True, False):
        tag = "triton" if use_triton else "torch"
        cases += [
            (f"unpermute_activation ({tag})",
             lambda u=use_triton: moelab.unpermute_activation(act, e2p, T, K, validate=False, use_triton=u),
             live * I * b + T * K * 4 + T * K * I * b,
             lambda got: rel_err(got[rows_k], ref_act)),
            (f"finalize_with_w2_lora ({tag})",
             lambda u=use_triton: moelab.finalize_with_w2_lora(out, gemm2, ew, e2p, w2_delta, validate=False,
                                                               use_triton=u),
             live * H * b + T * K * (H * b + b + 4) + T * H * b, lambda got: rel_err(got[rows], ref_fin[True])),
            (f"finalize_with_w2_lora, no delta ({tag})",
             lambda u=use_triton: moelab.finalize_with_w2_lora(out, gemm2, ew, e2p, None, validate=False,
                                                               use_triton=u),
             live * H * b + T * K * (b + 4) + T * H * b, lambda got: rel_err(got[rows], ref_fin[False])),
        ]
    for name, fn, nbytes, err_of in cases:
        row = {"mode": "ops", "shape": shape.name, "routing": "uniform", "impl": name, "variant": "none", "T": T,
               "bytes": nbytes}
        if runner.over_budget():
            row["skipped"] = "time budget spent"
        else:
            try:
                row["rel_err"] = err_of(fn().clone())
                row["checked_tokens"] = len(rows)
                row["check"] = "ok" if row["rel_err"] < MOELAB_TOL else "FAIL"
                us = median_us(fn, device, warmup_ms=a.warmup_ms, rep_ms=a.rep_ms, cpu_reps=a.cpu_reps,
                               cpu_warmup=0)
                row.update(median_us=us, GB_s=nbytes / (us * 1e-6) / 1e9,
                           frac_copy_bw=nbytes / (us * 1e-6) / runner.ceilings.bandwidth)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
        runner.results["rows"].append(row)
        if "median_us" in row:
            runner.log(f"[ops {shape.name}] T={T} {name:<44} {row['median_us']:10.1f} us  {row['GB_s']:8.1f} GB/s"
                       f"  {100 * row['frac_copy_bw']:5.1f}% of copy BW  err {row['rel_err']:.1e} {row['check']}")
        else:
            runner.log(f"[ops {shape.name}] T={T} {name:<44} {row.get('skipped') or row.get('error')}")
        runner.save()

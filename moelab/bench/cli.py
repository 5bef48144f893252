"""One MoE layer forward, bf16: moelab beside its peers and the roofline, all measured in one run.

Command line (``python -m moelab.bench --help``)::

    python -m moelab.bench                                  # Qwen3-30B-A3B, T = 1,32,128,1024,4096,16384, uniform
    python -m moelab.bench --routing uniform,zipf --shape qwen3-30b-a3b,olmoe,mixtral,gpt-oss-20b,deepseek-v3
    python -m moelab.bench --shape 64,8,2048,1024           # any E,K,H,I
    python -m moelab.bench --peers grouped_mm,hf            # only these peers beside moelab (--peers none: none)
    python -m moelab.bench --lora --ops                     # LoRA rows (r16, 1 and 4 adapters) + the two ops
    python -m moelab.bench --lora --lora-variants "8x mixed,32x mixed"   # serving banks of ranks 8-64
    python -m moelab.bench --shape gpt-oss-20b --activation swigluoai --bias   # GPT-OSS's experts
    python -m moelab.bench --quick                          # fewer T, fewer repetitions
    python -m moelab.bench --tiny                           # E=8 K=2 H=64 I=32, T=1,8: runs on a CPU (CI)

The command exits 1 when any row errors, fails its check against the float64 reference, or gives tokens without
an adapter that are not bit for bit the base path's output (each is printed on stderr as FAILED: ...).

What one run does, on a CUDA GPU:

1. Ceilings (``moelab.roofline.measure_ceilings``): a 2 GiB device-to-device copy (bytes read + written) and an
   8192^3 bf16 matmul, on fresh random data, ``triton.testing.do_bench(..., return_mode="median")``.
2. For each shape, routing and T: ``--sets`` input sets (x, routing, adapter ids) drawn at random (never zeros)
   and the float64 truth of ``moelab.reference`` (``routed_moe``; LoRA: ``lora_experts``) for ``--check-tokens``
   of set 0's tokens (all of them when T is small). Then for every implementation: one call on set 0, its checked
   tokens compared with the reference (``||out - ref|| / ||ref||`` under 1e-2 for moelab, 2e-2 for peers) and
   every element of its output finite; the peak memory one eager call allocates
   (``torch.cuda.max_memory_allocated``, reset before the call, minus what was allocated before it); then the
   median time over calls that rotate through the sets (``do_bench``: an L2 flush before each). For moelab's rows
   up to ``--graph-max-t`` on a GPU also the same calls back to back (``moelab.roofline.back_to_back_us``: 50
   calls, one synchronize, best of 3 rounds, no flush). The median hides host time up to the flush's GPU time (the
   host launches the call while the GPU clears the flush buffer); back to back, a host-bound eager call shows its
   host time. The report gives eager / [graph] both ways. A broken peer records its error and the run goes on.
3. Each row is printed as it is measured, beside the roofline (``moelab.roofline.roofline``: touched experts'
   weight bytes + activations over the measured copy bandwidth, ``6*T*K*H*I`` FLOPs over the measured matmul
   rate, the larger wins), and written to ``--out`` (JSON, rewritten after every row; default
   ``build/bench/bench.json``, or ``$OUT/bench.json``) with the markdown tables beside it (``.md``).

Implementations, base mode (``--peers`` picks the peers by the key in brackets; ``--impls`` keeps those whose name
contains one of its comma-separated words):

    moelab triton           routed_moe, packed routing, validate=False, do_finalize=True
    moelab triton [graph]   the same captured in a CUDA graph (one graph per input set), T <= --graph-max-t
    moelab flashinfer       only where that backend runs (SM 10.x with flashinfer installed)
    moelab torch [torch]    moelab's plain-PyTorch backend (per-expert loop, host syncs)
    naive loop [naive]      what a reader writes first: for each expert, where(), two matmuls, index_add_
    torch grouped_mm [grouped_mm]   slots sorted by expert, torch._grouped_mm for gate_up and down; sync-free
    HF eager, HF grouped_mm [hf-eager, hf-grouped_mm]   transformers' Qwen3MoeExperts with
                            config._experts_implementation = "eager" / "grouped_mm"
    Liger fused MoE [liger] liger_kernel.ops.fused_moe.LigerFusedMoEFunction (Triton), pinned to one config
                            (LIGER_FUSED_MOE_AUTOTUNE=0) unless --liger-autotune

LoRA mode (``--lora``; variants from ``--lora-variants``, or "Nx all" and "Nx half" at ``--rank`` for each N of
``--adapters``; "Nx all": every token has one of N adapters, "Nx half": half of the tokens have -1, "Nx mixed":
N adapters of ranks 64, 32, 16, 8, 64, ... with tokens spread over all of them; the "all"/"half" variants share one
bank with as many slots as the widest, each mixed variant has its own bank of N slots):

    moelab triton               the base layer, no LoRA at all (the ratio column divides by this)
    moelab LoRAExperts          moelab.LoRAExperts(w13, w2, lora=bank, backend="triton"), called as a serving
                                engine would (has_lora known on the host, validate=False); also with all ids -1
    moelab LoRAExperts [path]   the same with one LoRA path forced, ``fused=path`` (``--lora-paths``)
    moelab LoRA ops [lora-ops]  vLLM's unfused flow from the public pieces: lora_segments, w13_lora_delta,
                                routed_moe(delta, do_finalize=False), unpermute_activation, w2_lora_delta,
                                finalize_with_w2_lora
    unfused LoRA (grouped_mm) [unfused]   vLLM-style separate launches, shrink and expand by torch._grouped_mm
    HF grouped_mm + PEFT [peft] peft.get_peft_model(LoraConfig(target_parameters=["gate_up_proj", "down_proj"]))
                                on HF's experts module; one adapter for the whole batch, so "1x all" only

moelab's rows with tokens of lora_id -1 are compared bit for bit with the base path's output
(``base_rows_bitwise``). transformers, PEFT and Liger are imported only when their peer runs.

``--ops``: ``unpermute_activation`` and ``finalize_with_w2_lora`` (Triton and torch fallback) at T=16384 as
achieved GB/s (bytes read + written) and the fraction of the measured copy bandwidth.

The roofline itself (shapes, ceilings, floor) is :mod:`moelab.roofline`; its names are re-exported here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import subprocess
import sys
import traceback

import torch

import moelab
from moelab.bench.report import failures
from moelab.bench.runner import BASE_PEERS, LORA_PEERS, PEER_GROUPS, Runner, parse_peers, run_ops, run_shape
from moelab.lab import resolve_device
from moelab.roofline import H200_CEILINGS, SHAPES, get_shape, measure_ceilings


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return None


def _commit() -> str:
    for var in ("MOELAB_COMMIT", "GIT_COMMIT"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("+dirty" if dirty else "")) if sha else "unknown"
    except Exception:
        return "unknown"


def kernel_switches() -> dict:
    """The switches that pick which kernels the triton backend runs, as this process has them: ``MOELAB_GLUON``
    (the Gluon GEMMs on sm_90), ``MOELAB_TMA`` (TMA loads), ``MOELAB_FAST_LAUNCH``, ``MOELAB_EAGER_GRAPHS``,
    ``MOELAB_TILE_SCHEDULE`` (the Gluon GEMMs' tile schedule)."""
    from moelab.backends import eager_graphs
    from moelab.kernels import gluon_gemm, launch, moe_gemm

    return {"MOELAB_GLUON": gluon_gemm.GLUON, "MOELAB_TMA": moe_gemm.TMA, "MOELAB_FAST_LAUNCH": launch.FAST_LAUNCH,
            "MOELAB_EAGER_GRAPHS": eager_graphs.ENABLED, "MOELAB_TILE_SCHEDULE": gluon_gemm.TILE_SCHEDULE}


def _env(device: torch.device) -> dict:
    import triton

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": _version("transformers"), "peft": _version("peft"),
            "liger_kernel": _version("liger-kernel") or _version("liger_kernel"), "moelab": moelab.__version__,
            "commit": _commit(), "python": sys.version.split()[0],
            "triton_interpret": device.type != "cuda",  # moelab's kernels: interpreted off CUDA
            "switches": kernel_switches(), "tile_table": _tile_table(device)}


def _tile_table(device: torch.device) -> str:
    """Which tile table the triton backend's GEMMs read on ``device``: a tuning run's own file, or the shipped one."""
    from moelab.kernels import moe_gemm

    own = moe_gemm.own_tile_table_file(moe_gemm.device_limits(device)) if device.type == "cuda" else None
    return str(own) if own is not None else "shipped (moelab/kernels/moe_gemm_configs.json)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moelab.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b",
                   help=f"comma list of {sorted(SHAPES)} or E,K,H,I (one shape) [qwen3-30b-a3b]")
    p.add_argument("--tokens", default=None, help="comma list of T [1,32,128,1024,4096,16384]")
    p.add_argument("--routing", default="uniform", help="comma list of uniform, zipf [uniform]")
    p.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent of expert popularity [1.2]")
    p.add_argument("--peers", default="all",
                   help=f"peers beside moelab's main rows: comma list of {list(BASE_PEERS)} (base), "
                        f"{list(LORA_PEERS)} (--lora), or {list(PEER_GROUPS)} [all]")
    p.add_argument("--lora", action="store_true", help="LoRA rows instead of the base-layer peers")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the 'all'/'half' variants [16]")
    p.add_argument("--adapters", default="1,4", help="comma list of adapter counts N: 'Nx all,Nx half' [1,4]")
    p.add_argument("--lora-variants", default="",
                   help="comma list of 'Nx all' (every token one of N adapters), 'Nx half' (half the tokens -1), "
                        "'Nx mixed' (N adapters of ranks 64,32,16,8,64,...; tokens spread over all N), "
                        "'Nx mixed half'; e.g. '1x all,4x half,8x mixed,32x mixed' (overrides --adapters)")
    p.add_argument("--activation", default="silu", choices=["silu", "gelu", "gelu_tanh", "swigluoai"],
                   help="the experts' gated activation (base mode; 'swigluoai': GPT-OSS's clamped SwiGLU) [silu]")
    p.add_argument("--bias", action="store_true", help="random GEMM1 and GEMM2 biases (base mode; GPT-OSS has them)")
    p.add_argument("--lora-paths", default="auto",
                   help="comma list of LoRAExperts paths to time: 'auto' (the module's choice) and the names of "
                        "moelab.experts.LORA_PATHS (tiles, decode, adapter-loop, token-major, flow, flow-grouped, "
                        "flow-per-slot), each forced with fused=<name>; a path the bank or T cannot take is skipped "
                        "[auto]")
    p.add_argument("--ops", action="store_true", help="also unpermute_activation / finalize_with_w2_lora GB/s")
    p.add_argument("--ops-tokens", type=int, default=16384, help="T of --ops [16384]")
    p.add_argument("--impls", default="", help="keep implementations whose name contains one of these words")
    p.add_argument("--check-tokens", type=int, default=16,
                   help="tokens of each output checked against the float64 reference (all when T is at most "
                        "this; else the first, the last and random others) [16]")
    p.add_argument("--sets", type=int, default=None, help="input sets rotated while timing [4; quick 2]")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up ms [25; quick 10]")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench repetition ms [100; quick 40]")
    p.add_argument("--cpu-reps", type=int, default=3, help="timed calls per measurement on a CPU [3]")
    p.add_argument("--no-graphs", dest="graphs", action="store_false", help="skip the CUDA-graph rows")
    p.add_argument("--graph-max-t", type=int, default=1024, help="CUDA-graph rows only for T <= this [1024]")
    p.add_argument("--liger-autotune", action="store_true",
                   help="let Liger autotune (~100 Triton compiles on first call) instead of its pinned config")
    p.add_argument("--quick", action="store_true", help="T = 1,128,4096, 2 input sets, shorter do_bench")
    p.add_argument("--tiny", action="store_true", help="shape tiny (E=8 K=2 H=64 I=32), T = 1,8: CPU-friendly")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; once spent, remaining measurements are recorded as skipped")
    p.add_argument("--no-ceilings", dest="ceilings", action="store_false",
                   help="use the H200 ceilings measured 2026-11-29 instead of measuring them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path ($OUT/bench.json if OUT is set, else "
                   "build/bench/bench.json); a .md of the tables is written beside it")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing implementations")
    return p


def _finish_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.tiny:
        args.shape = "tiny"
        args.tokens = args.tokens or "1,8"
        args.ops_tokens = min(args.ops_tokens, 64)
    args.tokens = args.tokens or ("1,128,4096" if args.quick else "1,32,128,1024,4096,16384")
    args.sets = args.sets or (2 if (args.quick or args.tiny) else 4)
    args.warmup_ms = args.warmup_ms if args.warmup_ms is not None else (10 if args.quick else 25)
    args.rep_ms = args.rep_ms if args.rep_ms is not None else (40 if args.quick else 100)
    if args.out is None:
        args.out = os.path.join(os.environ["OUT"] if os.environ.get("OUT") else "build/bench", "bench.json")
    if args.check_tokens < 1:
        p.error(f"--check-tokens: expected at least 1, got {args.check_tokens}")
    if args.lora and (args.activation != "silu" or args.bias):
        p.error("--activation/--bias: the LoRA rows run SwiGLU without biases (LoRAExperts' experts); drop --lora")
    try:  # bad spellings fail here, before any GPU time is spent
        args.peer_keys = parse_peers(args.peers)
        args.shapes = [get_shape(s) for s in _split_shapes(args.shape)]
        if args.lora:
            from moelab.bench.runner import parse_variants

            parse_variants(args.lora_variants, args.adapters)
        [int(t) for t in args.tokens.split(",") if t.strip()]
        from moelab.experts import LORA_PATHS

        bad = [p for p in args.lora_paths.split(",") if p not in ("auto",) + LORA_PATHS]
        if bad:
            raise ValueError(f"--lora-paths: expected 'auto' or names of {LORA_PATHS}, got {bad}")
    except ValueError as e:
        p.error(str(e))
    return args


def _split_shapes(text: str) -> list[str]:
    """'qwen3,olmoe' -> two names; '128,8,2048,768' (all digits) -> one E,K,H,I shape; ';' separates E,K,H,I."""
    if ";" in text:
        return [t.strip() for t in text.split(";") if t.strip()]
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if parts and all(p.isdigit() for p in parts):
        return [",".join(parts)]
    return parts


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark as the CLI would (``argv`` as for ``python -m moelab.bench``); return the results dict
    (``rows``, ``ceilings``, ``env``, ``markdown``, ...), also written to ``--out``. :func:`failures` of it lists
    what makes the CLI exit non-zero."""
    parser = build_parser()
    args = _finish_args(parser, parser.parse_args(argv))
    device = resolve_device("auto")
    results = {"command": "python -m moelab.bench " + " ".join(shlex.quote(a) for a in (argv or [])),
               "config": {k: v for k, v in vars(args).items() if k not in ("shapes", "peer_keys")},
               "env": _env(device), "rows": []}
    results["config"]["peers"] = sorted(args.peer_keys)
    print(f"moelab.bench on {results['env']['device']}: torch {torch.__version__}, triton "
          f"{results['env']['triton']}, transformers {results['env']['transformers']}, peft {results['env']['peft']},"
          f" liger-kernel {results['env']['liger_kernel']}, commit {results['env']['commit']}", flush=True)
    if device.type != "cuda" and not args.tiny:
        print("no CUDA GPU: timings come from time.perf_counter on the CPU (use --tiny there)", flush=True)
    ceilings = measure_ceilings(device) if args.ceilings else H200_CEILINGS
    results["ceilings"] = dataclasses.asdict(ceilings)
    print(f"ceilings: {ceilings}", flush=True)
    runner = Runner(args, device, ceilings, results)
    with torch.no_grad():
        for shape in args.shapes:
            for routing in [r.strip() for r in args.routing.split(",") if r.strip()]:
                try:
                    run_shape(runner, shape, routing, "lora" if args.lora else "base")
                except Exception as e:  # weights or bank did not fit, ...: keep what was measured, go on
                    print(f"{shape.name} {routing}: {type(e).__name__}: {e}", flush=True)
                    results.setdefault("errors", []).append(f"{shape.name} {routing}: {type(e).__name__}: {e}")
                    if args.verbose:
                        traceback.print_exc()
            if args.ops:
                run_ops(runner, shape)
    runner.save()
    print("\n" + results["markdown"], flush=True)
    print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.md in {results['elapsed_s']} s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    """The CLI: 1 when any row errored, failed its check against the float64 reference, or gave tokens without
    an adapter that are not bit for bit the base path's output (each printed to stderr); else 0."""
    results = run(sys.argv[1:] if argv is None else argv)
    bad = failures(results)
    for line in bad:
        print(f"FAILED: {line}", file=sys.stderr, flush=True)
    return 1 if bad else 0


def console_main() -> None:
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())

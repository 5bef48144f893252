"""The command line: ``python -m moelab.bench --help``; :func:`run` is the same as a function."""

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


def _env(device: torch.device) -> dict:
    import triton

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": _version("transformers"), "peft": _version("peft"),
            "liger_kernel": _version("liger-kernel") or _version("liger_kernel"), "moelab": moelab.__version__,
            "commit": _commit(), "python": sys.version.split()[0],
            "triton_interpret": device.type != "cuda"}  # moelab's kernels: interpreted off CUDA


def build_parser() -> argparse.ArgumentParser:
    from moelab import bench

    p = argparse.ArgumentParser(prog="python -m moelab.bench", description=bench.__doc__,
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
    try:  # bad spellings fail here, before any GPU time is spent
        args.peer_keys = parse_peers(args.peers)
        args.shapes = [get_shape(s) for s in _split_shapes(args.shape)]
        if args.lora:
            from moelab.bench.runner import parse_variants

            parse_variants(args.lora_variants, args.adapters)
        [int(t) for t in args.tokens.split(",") if t.strip()]
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

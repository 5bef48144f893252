"""The lab: run every notebook (``make lab``), and the few helpers the notebooks share.

    python -m moelab.lab --out build            every notebooks/*.ipynb, in order, executed into build/
    python -m moelab.lab --out build --smoke    tiny shapes even on a GPU (what CI and the tests run)
    python -m moelab.lab --out build --full     full shapes even without a GPU (slow: Triton interprets)
    python -m moelab.lab --only 03              the notebooks whose name contains "03"

Each notebook is executed by papermill with its ``parameters`` cell overridden: ``SMOKE`` (True without a CUDA
GPU, False with one, unless ``--smoke``/``--full`` says otherwise), ``INTERACTIVE=False`` (widgets are for a
person at JupyterLab, never needed headless) and ``OUT_DIR=<out>/figures/<notebook>`` where it saves its PNGs.
Executed notebooks land in ``<out>/<notebook>.ipynb``. A notebook fails when any cell raises (its assertions
against ``moelab.reference`` included); the run goes on with the next one and exits non-zero naming the failures.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

__all__ = ["NOTEBOOK_DIR", "find_notebooks", "run_notebook", "main", "resolve_device", "rel_err",
           "markdown_table", "source_excerpt"]

#: ``notebooks/`` of this checkout (next to the package).
NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
_REPO_ROOT = NOTEBOOK_DIR.parent


# ---------------------------------------------------------------------------------------------- notebook helpers

def resolve_device(name: str = "auto") -> torch.device:
    """The notebooks' ``DEVICE`` parameter: "auto" is the CUDA GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (SPEC §7); inf when either holds a NaN (NaN never passes)."""
    out64, ref64 = out.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    if out64.shape != ref64.shape:
        raise ValueError(f"out: expected the reference's shape {list(ref64.shape)}, got {list(out64.shape)}")
    if torch.isnan(out64).any() or torch.isnan(ref64).any():
        return float("inf")
    num, den = (out64 - ref64).norm().item(), ref64.norm().item()
    return num / den if den > 0 else num


def markdown_table(rows: Sequence[Mapping[str, object]], *, floatfmt: str = ".3g") -> str:
    """A Markdown table of ``rows`` (dicts sharing keys), for ``IPython.display.Markdown``."""
    if not rows:
        return ""
    keys = list(rows[0])

    def cell(v) -> str:
        return format(v, floatfmt) if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def source_excerpt(obj, start: str | None = None, stop: str | None = None) -> str:
    """The source of a function or ``@triton.jit`` kernel, from the first line containing ``start`` up to (not
    including) the next line containing ``stop`` (None: from the top / to the end), dedented.

    Raises ValueError naming the marker when ``start`` or ``stop`` is not found, so a notebook whose excerpt went
    stale (the function was edited) fails instead of quietly showing other code.
    """
    fn = getattr(obj, "fn", obj)
    lines = inspect.getsource(fn).splitlines()
    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    first = 0 if start is None else next((i for i, line in enumerate(lines) if start in line), None)
    if first is None:
        raise ValueError(f"start: no line of {where} contains {start!r}; update the notebook's marker")
    last = len(lines) if stop is None else next((i for i in range(first + 1, len(lines)) if stop in lines[i]), None)
    if last is None:
        raise ValueError(f"stop: no line of {where} after {start!r} contains {stop!r}; update the notebook's marker")
    return textwrap.dedent("\n".join(lines[first:last]))


# ---------------------------------------------------------------------------------------------- runner

def find_notebooks(directory: str | os.PathLike | None = None, only: str | None = None) -> list[Path]:
    """The ``*.ipynb`` of ``directory`` (default ``notebooks/``), sorted: the curriculum's order."""
    directory = Path(directory) if directory is not None else NOTEBOOK_DIR
    found = sorted(p for p in directory.glob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    return [p for p in found if only is None or only in p.name]


def run_notebook(path: str | os.PathLike, out_dir: str | os.PathLike, *, smoke: bool,
                 parameters: Mapping[str, object] | None = None, timeout: float | None = 600) -> Path:
    """Execute one notebook with papermill (kernel ``python3``) into ``out_dir``; raise if a cell fails.

    Parameters given: ``SMOKE``, ``INTERACTIVE=False``, ``OUT_DIR=<out_dir>/figures/<stem>``, then
    ``parameters``. The kernel runs in the notebook's own folder, as in JupyterLab, with this checkout first on
    ``PYTHONPATH`` so ``import moelab`` finds it installed or not. ``timeout``: seconds per cell.
    Returns the path of the executed notebook.
    """
    import papermill  # imported here: the notebooks import moelab.lab for its helpers only

    path, out_dir = Path(path).resolve(), Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    params = {"SMOKE": smoke, "INTERACTIVE": False, "OUT_DIR": str(out_dir / "figures" / path.stem)}
    params.update(parameters or {})
    pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(_REPO_ROOT) + (os.pathsep + pythonpath if pythonpath else "")
    try:
        papermill.execute_notebook(str(path), str(out_dir / path.name), parameters=params, kernel_name="python3",
                                   cwd=str(path.parent), progress_bar=False, execution_timeout=timeout,
                                   extra_arguments=["--log-level=ERROR"])  # no kernel start-up warnings
    finally:
        if pythonpath is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = pythonpath
    return out_dir / path.name


def _failure_line(error: BaseException) -> str:
    ename, evalue = getattr(error, "ename", None), getattr(error, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return f"{type(error).__name__}: {error}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moelab.lab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="build", help="folder for executed notebooks and figures (default build)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", dest="smoke", action="store_true", default=None,
                      help="tiny shapes (default without a CUDA GPU)")
    size.add_argument("--full", dest="smoke", action="store_false", help="full shapes (default with a CUDA GPU)")
    parser.add_argument("--only", help="run only the notebooks whose file name contains this text")
    parser.add_argument("--notebooks", default=None, help=f"folder of notebooks (default {NOTEBOOK_DIR})")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per cell (default 600)")
    args = parser.parse_args(argv)

    smoke = (not torch.cuda.is_available()) if args.smoke is None else args.smoke
    paths = find_notebooks(args.notebooks, args.only)
    if not paths:
        print(f"no notebooks found in {args.notebooks or NOTEBOOK_DIR}" + (f" matching {args.only!r}" if args.only
                                                                             else ""), file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (Triton interpreter)"
    print(f"moelab lab: {len(paths)} notebooks, SMOKE={smoke}, on {device} -> {Path(args.out).resolve()}",
          flush=True)
    failed = []
    start_all = time.perf_counter()
    for i, path in enumerate(paths, 1):
        start = time.perf_counter()
        try:
            run_notebook(path, args.out, smoke=smoke, timeout=args.timeout)
            status = "ok"
        except Exception as error:  # papermill's execution error, a timeout, a dead kernel: report and go on
            failed.append(path.name)
            status = f"FAILED  {_failure_line(error)}"
        print(f"[{i}/{len(paths)}] {path.name:<28} {time.perf_counter() - start:6.1f} s  {status}", flush=True)
    total = time.perf_counter() - start_all
    if failed:
        print(f"{len(failed)} of {len(paths)} notebooks failed ({total:.0f} s): {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"all {len(paths)} notebooks ran ({total:.0f} s); executed notebooks and figures in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

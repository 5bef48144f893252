"""The lab: run every notebook (``make lab``), and the few helpers the notebooks share.

    python -m moelab.lab                        every notebooks/*.ipynb, in order, executed into build/lab/
    python -m moelab.lab --smoke                tiny shapes even on a GPU (what CI and the tests run)
    python -m moelab.lab --full                 full shapes even without a GPU (slow: Triton interprets)
    python -m moelab.lab --only 03              the notebooks whose name contains "03"
    python -m moelab.lab --break list           the planted faults of the bug hunt (moelab.faults)
    python -m moelab.lab --break sign-mask      run the notebooks with one fault planted: which assertion and
                                                which figure catch it

Each notebook is executed by papermill with its ``parameters`` cell overridden: ``SMOKE`` (True without a CUDA
GPU, False with one, unless ``--smoke``/``--full`` says otherwise), ``INTERACTIVE=False`` (widgets are for a
person at JupyterLab, never needed headless) and ``OUT_DIR=<out>/figures/<notebook>`` where it saves its PNGs.
Executed notebooks land in ``<out>/<notebook>.ipynb``. A notebook fails when any cell raises (its assertions
against ``moelab.reference`` included); the run goes on with the next one and exits non-zero naming the failures.

With ``--break NAME`` the kernels run with ``MOELAB_BREAK=NAME`` (see :mod:`moelab.faults`): one planted bug.
A notebook *catches* it when one of its assertions fails; the run prints that assertion's message and the
figures drawn last before it, writes into ``<out>/break-<NAME>/``, and exits 0 when some notebook caught the
fault, 1 when every notebook ran clean (the fault went unnoticed).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moelab import _runtime

__all__ = ["NOTEBOOK_DIR", "find_notebooks", "run_notebook", "main", "resolve_device", "rel_err",
           "markdown_table", "source_excerpt", "Catch", "hunt"]

#: ``notebooks/`` of this checkout (next to the package).
NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
_REPO_ROOT = NOTEBOOK_DIR.parent


# ---------------------------------------------------------------------------------------------- notebook helpers

def resolve_device(name: str = "auto") -> torch.device:
    """The notebooks' ``DEVICE`` parameter: "auto" is the CUDA GPU when there is one, else the CPU."""
    if name == "auto":
        return _runtime.default_device()
    return torch.device(name)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (docs/contract.md §7); inf when either holds a NaN (NaN never passes)."""
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
                 parameters: Mapping[str, object] | None = None, timeout: float | None = 600,
                 fault: str | None = None) -> Path:
    """Execute one notebook with papermill (kernel ``python3``) into ``out_dir``; raise if a cell fails.

    Parameters given: ``SMOKE``, ``INTERACTIVE=False``, ``OUT_DIR=<out_dir>/figures/<stem>``, then
    ``parameters``. The kernel runs in the notebook's own folder, as in JupyterLab, with this checkout first on
    ``PYTHONPATH`` so ``import moelab`` finds it installed or not. ``timeout``: seconds per cell. ``fault``: a
    name of :data:`moelab.faults.FAULTS`, planted in the kernel through ``MOELAB_BREAK``.
    Returns the path of the executed notebook.
    """
    import papermill  # imported here: the notebooks import moelab.lab for its helpers only

    path, out_dir = Path(path).resolve(), Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    params = {"SMOKE": smoke, "INTERACTIVE": False, "OUT_DIR": str(out_dir / "figures" / path.stem)}
    params.update(parameters or {})
    from moelab import faults

    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", faults.ENV_VAR)}
    os.environ["PYTHONPATH"] = str(_REPO_ROOT) + (os.pathsep + saved["PYTHONPATH"] if saved["PYTHONPATH"] else "")
    os.environ.pop(faults.ENV_VAR, None)
    if fault is not None:
        if fault not in faults.FAULTS:
            raise ValueError(f"fault: unknown name {fault!r}; expected one of {', '.join(faults.FAULTS)}")
        os.environ[faults.ENV_VAR] = fault
    try:
        papermill.execute_notebook(str(path), str(out_dir / path.name), parameters=params, kernel_name="python3",
                                   cwd=str(path.parent), progress_bar=False, execution_timeout=timeout,
                                   extra_arguments=["--log-level=ERROR"])  # no kernel start-up warnings
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return out_dir / path.name


_SAVED_FIGURE = re.compile(r"save_figure\([^,]+,\s*OUT_DIR\s*,\s*[\"']([^\"']+)[\"']")


@dataclass
class Catch:
    """What one notebook did with a planted fault (:func:`hunt`)."""

    notebook: str
    ename: str | None = None  # the exception of the failing cell; None: every cell ran
    evalue: str = ""
    cell: int | None = None  # index of the failing cell in the executed notebook
    figures: list[Path] = field(default_factory=list)  # drawn by the last cell before it that saved any

    @property
    def caught(self) -> bool:
        """An assertion of the notebook failed (a crash of another kind is not a catch)."""
        return self.ename == "AssertionError"


def _catch(path: Path, executed: Path, out_dir: Path, error: BaseException | None) -> Catch:
    catch = Catch(path.name)
    if error is None:
        return catch
    catch.ename = getattr(error, "ename", None) or type(error).__name__
    catch.evalue = str(getattr(error, "evalue", None) or error)
    if not executed.exists():
        return catch
    cells = json.loads(executed.read_text())["cells"]
    failing = next((i for i, c in enumerate(cells) if c["cell_type"] == "code"
                    and any(o.get("output_type") == "error" for o in c.get("outputs", []))), None)
    if failing is None:
        return catch
    catch.cell = failing
    for cell in reversed(cells[: failing + 1]):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        names = _SAVED_FIGURE.findall(source) if cell["cell_type"] == "code" else []
        found = [out_dir / "figures" / path.stem / f"{n}.png" for n in names]
        found = [f for f in found if f.exists()]
        if found:
            catch.figures = found
            break
    return catch


def hunt(fault: str, paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike, *, smoke: bool,
         stop_at_first: bool = False, timeout: float | None = 600, report=None) -> list[Catch]:
    """Run ``paths`` with ``fault`` planted, in order; one :class:`Catch` per notebook run.

    ``stop_at_first``: stop after the first notebook that catches it. ``report``: called with each Catch as it
    comes (e.g. to print it).
    """
    out_dir = Path(out_dir).resolve()
    catches = []
    for path in map(Path, paths):
        try:
            executed = run_notebook(path, out_dir, smoke=smoke, timeout=timeout, fault=fault)
            error = None
        except Exception as e:  # the catch (or a crash): recorded, and the hunt goes on
            executed, error = out_dir / path.name, e
        catches.append(_catch(path, executed, out_dir, error))
        if report is not None:
            report(catches[-1])
        if stop_at_first and catches[-1].caught:
            break
    return catches


def _failure_line(error: BaseException) -> str:
    ename, evalue = getattr(error, "ename", None), getattr(error, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return f"{type(error).__name__}: {error}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moelab.lab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="build/lab",
                        help="where executed notebooks and figures go (default build/lab)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", dest="smoke", action="store_true", default=None,
                      help="tiny shapes (default without a CUDA GPU)")
    size.add_argument("--full", dest="smoke", action="store_false", help="full shapes (default with a CUDA GPU)")
    parser.add_argument("--only", help="run only the notebooks whose file name contains this text")
    parser.add_argument("--notebooks", default=None, help=f"folder of notebooks (default {NOTEBOOK_DIR})")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per cell (default 600)")
    parser.add_argument("--break", dest="fault", metavar="NAME",
                        help="bug hunt: plant the fault NAME (moelab.faults) and show which notebook catches it; "
                             "'list' lists the faults")
    args = parser.parse_args(argv)

    if args.fault == "list":
        from moelab import faults

        print(faults.describe())
        return 0
    smoke = (not torch.cuda.is_available()) if args.smoke is None else args.smoke
    paths = find_notebooks(args.notebooks, args.only)
    if not paths:
        print(f"no notebooks found in {args.notebooks or NOTEBOOK_DIR}" + (f" matching {args.only!r}" if args.only
                                                                             else ""), file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (Triton interpreter)"
    if args.fault is not None:
        return _main_break(args.fault, paths, Path(args.out) / f"break-{args.fault}", smoke, args.timeout, device)
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


def _main_break(name: str, paths: Sequence[Path], out: Path, smoke: bool, timeout: float, device: str) -> int:
    from moelab import faults

    if name not in faults.FAULTS:
        print(f"--break: unknown fault {name!r}; python -m moelab.lab --break list names them: "
              f"{', '.join(faults.FAULTS)}", file=sys.stderr)
        return 2
    fault = faults.FAULTS[name]
    print(f"moelab lab, bug hunt: fault {name!r} planted ({fault.target} replaced)\n  {fault.what}\n"
          f"  {len(paths)} notebooks, SMOKE={smoke}, on {device} -> {out.resolve()}", flush=True)
    start = [time.perf_counter()]

    def report(catch: Catch) -> None:
        seconds = time.perf_counter() - start[0]
        if catch.caught:
            status = f"CAUGHT by cell {catch.cell}: {catch.ename}: {catch.evalue}"
        elif catch.ename:
            status = f"FAILED, not an assertion, in cell {catch.cell}: {catch.ename}: {catch.evalue}"
        else:
            status = "ran clean: did not notice"
        print(f"  {catch.notebook:<28} {seconds:6.1f} s  {status}", flush=True)
        if catch.ename and catch.figures:
            label = "the figure drawn before it:" if len(catch.figures) == 1 else "the figures drawn before it:"
            print("\n".join(f"  {'':<37}{label if i == 0 else '':<29} {figure}"
                            for i, figure in enumerate(catch.figures)), flush=True)
        start[0] = time.perf_counter()

    catches = hunt(name, paths, out, smoke=smoke, timeout=timeout, report=report)
    caught = [c.notebook for c in catches if c.caught]
    if caught:
        print(f"fault {name!r} caught by {', '.join(caught)}; executed notebooks in {out}")
        return 0
    print(f"fault {name!r} went unnoticed by every notebook run (expected: {', '.join(fault.caught_by)})",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""The docs users read run as written: every ```python block of the README (in order, one namespace, as a reader
pastes them), the example of every public callable's docstring (doctest), and the contract's section pointers.
"""

from __future__ import annotations

import doctest
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moelab

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONTRACT = ROOT / "docs" / "contract.md"


#: Appended to a torchrun block: its rank and the gloo threads (by their Linux names) still running at its end.
GLOO_THREADS_LEFT = """
def _gloo_threads_left():
    import os
    if not os.path.isdir("/proc/self/task"):
        return -1  # no /proc: not counted
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read())
        except FileNotFoundError:
            pass
    return sum("gloo" in name for name in names)
print(f"README block done on rank {rank}; gloo threads left: {_gloo_threads_left()}", flush=True)
"""


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def test_readme_python_blocks_run_as_written(tmp_path):
    """The blocks in order in one namespace, as a reader pastes them; a block that says it runs under ``torchrun``
    runs so, on 2 gloo ranks (loopback only)."""
    blocks = python_blocks(README)
    assert len(blocks) >= 2, "the README's Use section has its python blocks"
    namespace: dict = {"__name__": "__readme__"}
    for i, block in enumerate(blocks):
        if block.startswith("# torchrun"):
            script = tmp_path / f"readme_block_{i + 1}.py"
            # The marker shows every line ran on both ranks, and how many gloo threads the block left running: a
            # group alive at interpreter exit can abort a gloo rank there (moelab.distributed's docstring), which
            # the exit code shows only now and then; a group left after destroy_process_group shows every time.
            script.write_text(block + GLOO_THREADS_LEFT)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                  "2", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=240)
            assert run.returncode == 0, f"README.md python block {i + 1} under torchrun:\n{run.stderr[-3000:]}"
            done = sorted(re.findall(r"README block done on rank (\d); gloo threads left: (-?\d+)", run.stdout))
            ranks, left = [r for r, _ in done], [n for _, n in done]
            assert ranks == ["0", "1"], f"README.md python block {i + 1}: ranks that finished: {ranks}\n{run.stdout}"
            assert set(left) <= {"0", "-1"}, f"README.md python block {i + 1} leaves its process group running: " \
                                             f"gloo threads per rank {left}"
            continue
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:
            pytest.fail(f"README.md python block {i + 1} raised {type(e).__name__}: {e}\n{block}")
    assert "out" in namespace and namespace["out"].shape[0] == namespace["x"].shape[0]


def public_callables():
    """Every name of ``moelab.__all__``, and the public methods of its classes (properties and dunders aside)."""
    found = []
    for name in moelab.__all__:
        obj = getattr(moelab, name)
        found.append((name, obj))
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if not attr.startswith("_") and (inspect.isfunction(value) or isinstance(value, classmethod)):
                    found.append((f"{name}.{attr}", getattr(obj, attr)))
    return found


@pytest.mark.parametrize("name, obj", public_callables(), ids=[n for n, _ in public_callables()])
def test_public_callable_has_a_runnable_example(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert ">>>" in doc, f"moelab.{name}: its docstring has no example (>>>)"
    assert inspect.getdoc(obj) != inspect.getdoc(torch.nn.Module.forward), f"moelab.{name}: torch's generic docstring"
    module = inspect.getmodule(obj)
    globs = {**vars(module), "torch": torch, "moelab": moelab}
    test = doctest.DocTestParser().get_doctest(doc, globs, f"moelab.{name}", inspect.getsourcefile(obj), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    report: list[str] = []
    runner.run(test, out=report.append)
    assert runner.failures == 0, f"moelab.{name}: its example fails:\n{''.join(report)}"
    assert runner.tries > 0


def tracked_text_files():
    """The repository's own text files (a walk, so it works in a copy without .git too)."""
    suffixes = {".py", ".md", ".ipynb", ".toml", ".yml", ".cfg"}
    skip = {".git", ".venv", "build", "benchmarks", "__pycache__", ".ipynb_checkpoints", ".hypothesis",
            ".pytest_cache", ".ruff_cache", "moelab.egg-info"}
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".dev_")]
        found += [Path(dirpath) / f for f in filenames if Path(f).suffix in suffixes]
    return found


def test_no_citation_of_a_file_users_do_not_have():
    """The contract lives in docs/contract.md; nothing cites the team's own spec file."""
    pattern = re.compile(r"SPEC §|SPEC\.md|the SPEC\b")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in tracked_text_files() if p.name != "test_docs.py"
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not hits, f"cite docs/contract.md instead: {hits[:20]}"


def test_contract_sections_cited_exist():
    sections = set(re.findall(r"^## (§\d+)", CONTRACT.read_text(), flags=re.M))
    assert sections == {f"§{i}" for i in range(1, 8)}, sections
    cited = {}
    for p in tracked_text_files():
        for m in re.finditer(r"docs/contract\.md((?:,? ?§\d+)+)", p.read_text(errors="replace")):
            for s in re.findall(r"§\d+", m.group(1)):
                cited.setdefault(s, str(p.relative_to(ROOT)))
    assert cited, "the code cites docs/contract.md"
    unknown = {s: f for s, f in cited.items() if s not in sections}
    assert not unknown, f"docs/contract.md has no section {unknown}"

"""The notebooks (issue 5): each runs top to bottom with ``SMOKE=True, INTERACTIVE=False`` (its assertions against
``moelab.reference`` included), and each is stored clean: no outputs, one literal ``parameters`` cell, a kernelspec.

Execution goes through :func:`moelab.lab.run_notebook`, exactly as ``make lab`` runs them.
"""

import ast
import json

import pytest

from moelab.lab import NOTEBOOK_DIR, find_notebooks, run_notebook

NOTEBOOKS = find_notebooks()
#: Names every parameters cell declares (``lab`` passes SMOKE, INTERACTIVE and OUT_DIR; DEVICE is the user's).
REQUIRED_PARAMETERS = {"SMOKE", "INTERACTIVE", "DEVICE", "OUT_DIR"}


def _cells(path):
    return json.loads(path.read_text())["cells"]


def _source(cell) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def test_the_curriculum_is_there():
    names = [p.name for p in NOTEBOOKS]
    assert len(names) >= 7, f"expected notebooks 01..07 in {NOTEBOOK_DIR}, found {names}"
    numbers = [name[:2] for name in names]
    assert numbers == sorted(set(numbers)) and all(n.isdigit() for n in numbers), f"not numbered 01, 02, ...: {names}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    for i, cell in enumerate(_cells(path)):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{path.name} cell {i}: outputs are stored (strip them)"
            assert cell.get("execution_count") is None, f"{path.name} cell {i}: an execution_count is stored"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_has_a_python3_kernelspec(path):
    spec = json.loads(path.read_text())["metadata"].get("kernelspec", {})
    assert spec.get("name") == "python3", f"{path.name}: kernelspec {spec!r}, expected name 'python3'"
    assert spec.get("language") == "python"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_one_parameters_cell_of_literals(path):
    tagged = [c for c in _cells(path) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: expected exactly one cell tagged 'parameters', found {len(tagged)}"
    assert tagged[0]["cell_type"] == "code"
    names = {}
    for node in ast.parse(_source(tagged[0])).body:
        assert isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name), \
            f"{path.name}: the parameters cell may only hold `NAME = literal` lines, got {ast.unparse(node)!r}"
        try:
            names[node.targets[0].id] = ast.literal_eval(node.value)
        except ValueError:
            pytest.fail(f"{path.name}: parameter {node.targets[0].id} is not a literal: {ast.unparse(node.value)}")
    missing = REQUIRED_PARAMETERS - set(names)
    assert not missing, f"{path.name}: the parameters cell lacks {sorted(missing)}"
    assert isinstance(names["SMOKE"], bool) and isinstance(names["INTERACTIVE"], bool)
    assert names["INTERACTIVE"] is False, f"{path.name}: INTERACTIVE must default to False (headless runs)"
    assert names["DEVICE"] == "auto", f"{path.name}: DEVICE should default to 'auto'"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_widgets_only_when_interactive(path):
    """ipywidgets is imported only inside ``if INTERACTIVE:`` blocks: headless runs never need it."""
    for i, cell in enumerate(_cells(path)):
        if cell["cell_type"] != "code":
            continue
        tree = ast.parse(_source(cell))
        guarded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "INTERACTIVE":
                guarded |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and n.split(".")[0] == "ipywidgets" for n in names):
                    assert id(node) in guarded, f"{path.name} cell {i}: ipywidgets imported outside `if INTERACTIVE:`"


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_with_smoke(path, tmp_path):
    """Every cell runs; a failed assertion (a kernel off the reference) fails the notebook and this test."""
    executed = run_notebook(path, tmp_path, smoke=True)
    cells = json.loads(executed.read_text())["cells"]
    errors = [o for c in cells if c["cell_type"] == "code" for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, f"{path.name}: error output {errors[0].get('ename')}: {errors[0].get('evalue')}"
    figures = list((tmp_path / "figures" / path.stem).glob("*.png"))
    assert figures, f"{path.name}: saved no figure under OUT_DIR"


@pytest.mark.notebook
def test_lab_goes_on_and_names_the_failing_notebook(tmp_path, capsys):
    import nbformat

    from moelab import lab

    folder = tmp_path / "notebooks"
    folder.mkdir()
    for name, body in (("01-fails", "assert SMOKE is False, 'a broken kernel'"), ("02-runs", "print(OUT_DIR)")):
        params = nbformat.v4.new_code_cell('SMOKE = False\nINTERACTIVE = False\nDEVICE = "auto"\nOUT_DIR = "x"')
        params.metadata["tags"] = ["parameters"]
        nb = nbformat.v4.new_notebook(cells=[params, nbformat.v4.new_code_cell(body)])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, folder / f"{name}.ipynb")
    assert lab.main(["--notebooks", str(folder), "--out", str(tmp_path / "out"), "--smoke"]) == 1
    out, err = capsys.readouterr()
    assert "[1/2] 01-fails.ipynb" in out and "FAILED" in out and "AssertionError: a broken kernel" in out
    assert "[2/2] 02-runs.ipynb" in out and out.count(" ok") == 1
    assert "01-fails.ipynb" in err and "02-runs" not in err
    assert (tmp_path / "out" / "02-runs.ipynb").exists()


def test_source_excerpt_raises_on_a_stale_marker():
    from moelab import lab

    text = lab.source_excerpt(lab.rel_err, start="out64, ref64 =", stop="if torch.isnan")
    assert text.startswith("out64, ref64 =") and "isnan" not in text
    with pytest.raises(ValueError, match="start: no line of moelab.lab.rel_err contains 'no such line'"):
        lab.source_excerpt(lab.rel_err, start="no such line")
    with pytest.raises(ValueError, match="stop: .* contains 'no such line'"):
        lab.source_excerpt(lab.rel_err, start="out64", stop="no such line")

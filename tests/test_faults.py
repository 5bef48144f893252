"""The bug hunt (moelab.faults, ``python -m moelab.lab --break NAME``): every planted fault is caught by an
assertion of the notebooks it names, so the notebooks double as a mutation test of themselves.

Each fault runs only the notebooks it maps to (``Fault.caught_by``), stopping at the first that catches it; the
clean run of every notebook is tests/test_notebooks.py.
"""

import importlib
import os
import subprocess
import sys

import nbformat
import pytest
import torch

import moelab
from moelab import faults, lab, reference


def _holders(obj):
    return sorted(f"{name}.{attr}" for name, module in list(sys.modules.items())
                  if module is not None and (name == "moelab" or name.startswith("moelab."))
                  for attr, value in list(vars(module).items()) if value is obj)


@pytest.mark.parametrize("name", sorted(faults.FAULTS))
def test_planted_reaches_every_holder_and_is_taken_out(name):
    fault = faults.FAULTS[name]
    module_name, attr = fault.target.rsplit(".", 1)
    original = getattr(importlib.import_module(module_name), attr)
    holders = _holders(original)
    assert fault.target in holders
    with faults.planted(name):
        twin = getattr(sys.modules[module_name], attr)
        assert twin is not original and twin.__moelab_fault__ == name
        assert _holders(twin) == holders, "the twin must replace the function wherever moelab holds it"
        assert "PLANTED FAULT" in twin.__doc__
    assert _holders(original) == holders and not _holders(twin)


def test_public_names_are_swapped_and_the_reference_never():
    ids, weights = torch.tensor([[3, 1]]), torch.tensor([[0.5, -0.25]])
    with faults.planted("sign-mask"):
        from moelab.backends import lora_flow  # LoRAExperts' unfused flow imported it by name

        assert lora_flow.pack_topk_ids_weights is moelab.pack_topk_ids_weights
        assert moelab.unpack_topk_ids_weights(moelab.pack_topk_ids_weights(ids, weights))[0].tolist() == [[3, -1]]
        assert reference.unpack_topk_ids_weights(reference.pack_topk_ids_weights(ids, weights))[0].tolist() == [[3, 1]]
    assert moelab.unpack_topk_ids_weights(moelab.pack_topk_ids_weights(ids, weights))[0].tolist() == [[3, 1]]
    with pytest.raises(ValueError, match="unknown name 'nope'; expected one of sign-mask"):
        faults.plant("nope")


def test_the_environment_variable_plants_at_import():
    env = dict(os.environ, MOELAB_BREAK="unmasked-unpermute")
    code = ("import moelab; "
            "print(moelab.unpermute_activation.__moelab_fault__, moelab.ops.unpermute_activation.__name__)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["unmasked-unpermute", "unpermute_activation"]
    assert "planted fault 'unmasked-unpermute'" in done.stderr


def test_an_unknown_name_in_the_environment_fails_the_import(monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "nope")
    with pytest.raises(ValueError, match="unknown name 'nope'"):
        moelab._plant_fault_from_env()  # what `import moelab` runs
    monkeypatch.setenv(faults.ENV_VAR, "")
    assert faults.plant_from_env() is None


def test_break_list(capsys):
    assert lab.main(["--break", "list"]) == 0
    out = capsys.readouterr().out
    for fault in faults.FAULTS.values():
        assert fault.name in out and fault.target in out and fault.what in out


def test_every_fault_maps_to_notebooks_that_exist():
    numbers = {p.name[:2] for p in lab.find_notebooks()}
    for fault in faults.FAULTS.values():
        assert fault.caught_by and set(fault.caught_by) <= numbers, f"{fault.name}: {fault.caught_by}"
    required = {"sign-mask", "hf-order-delta", "unmasked-unpermute", "unweighted-w2-delta", "delta-before-scale",
                "dead-row-read"}
    assert required <= set(faults.FAULTS)


@pytest.mark.notebook
def test_break_reports_the_catch_and_the_clean_runs(tmp_path, capsys):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    bodies = {
        "01-clean": ["print('nothing here looks at packing')"],
        "02-catches": ["import moelab, torch\nfrom moelab import viz\n"
                       "w = moelab.pack_topk_ids_weights(torch.tensor([[1]]), torch.tensor([[-1.0]]))\n"
                       "viz.save_figure(viz.plot_packed_bits(w), OUT_DIR, 'bits')",
                       "assert moelab.unpack_topk_ids_weights(w)[0].item() == 1, 'the id is lost'"],
    }
    for name, cells in bodies.items():
        params = nbformat.v4.new_code_cell('SMOKE = False\nINTERACTIVE = False\nDEVICE = "auto"\nOUT_DIR = "x"')
        params.metadata["tags"] = ["parameters"]
        nb = nbformat.v4.new_notebook(cells=[params] + [nbformat.v4.new_code_cell(c) for c in cells])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, folder / f"{name}.ipynb")
    out = tmp_path / "out"
    assert lab.main(["--notebooks", str(folder), "--out", str(out), "--smoke", "--break", "sign-mask"]) == 0
    text = capsys.readouterr().out
    assert "01-clean.ipynb" in text and "ran clean: did not notice" in text
    assert "02-catches.ipynb" in text and "CAUGHT by cell" in text and "AssertionError: the id is lost" in text
    figure = out.resolve() / "break-sign-mask" / "figures" / "02-catches" / "bits.png"
    assert "the figure drawn before it:" in text and str(figure) in text
    assert lab.main(["--notebooks", str(folder), "--out", str(out), "--smoke", "--break", "sign-mask", "--only",
                     "01"]) == 1
    assert "went unnoticed" in capsys.readouterr().err
    assert lab.main(["--notebooks", str(folder), "--out", str(out), "--break", "nope"]) == 2


@pytest.mark.notebook
@pytest.mark.parametrize("name", sorted(faults.FAULTS))
def test_the_notebooks_catch_the_fault(name, tmp_path):
    fault = faults.FAULTS[name]
    paths = [p for number in fault.caught_by for p in lab.find_notebooks(only=f"{number}-")]
    catches = lab.hunt(name, paths, tmp_path, smoke=True, stop_at_first=True)
    seen = [f"{c.notebook}: {c.ename or 'ran clean'} {c.evalue[:200]}" for c in catches]
    assert catches[-1].caught, f"fault {name!r} ({fault.what}) went uncaught by {fault.caught_by}: {seen}"
    assert catches[-1].figures, f"{catches[-1].notebook} caught {name!r} before drawing any figure"

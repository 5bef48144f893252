"""moelab.diagnose: failing checks name the rows and what they share; passing checks stay quiet."""

import doctest

import pytest
import torch

from moelab import diagnose


def test_doctest():
    assert doctest.testmod(diagnose).failed == 0


def test_close_names_the_rows_and_their_facts():
    ref = torch.randn(16, 8, dtype=torch.float64)
    out = ref.clone()
    out[[3, 11]] += 1.0
    dropped = torch.zeros(16, dtype=torch.bool)
    dropped[[3, 11, 12]] = True
    with pytest.raises(AssertionError) as info:
        diagnose.assert_close("output", out, ref, tol=1e-2, facts={"map == -1": dropped})
    msg = str(info.value)
    assert msg.startswith("output: rel err ") and "tokens 3, 11 (2 of 16) are off by more than 1e-02" in msg
    assert "all 2 have map == -1 (1 of the 14 others)" in msg
    assert diagnose.assert_close("output", out, ref, tol=10.0) < 10.0


def test_close_flags_nan_rows():
    ref = torch.ones(4, 3)
    out = ref.clone()
    out[1, 0] = float("nan")
    with pytest.raises(AssertionError, match=r"rel err inf .*token 1 \(1 of 4\) .*hold NaN or inf"):
        diagnose.assert_close("x", out, ref, tol=1e-2)


def test_equal_and_rows():
    diagnose.assert_equal("same", torch.arange(6).view(3, 2), torch.arange(6).view(3, 2))
    diagnose.assert_equal("nan equals nan", torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    got = torch.tensor([[1, 2], [3, 4], [5, 6]])
    want = got.clone()
    want[2, 1] = 0
    with pytest.raises(AssertionError, match=r"^words: word 2 \(1 of 3\) differ; it has the sign bit"):
        diagnose.assert_equal("words", got, want, row="word", facts={"the sign bit": torch.tensor([0, 0, 1])})
    with pytest.raises(AssertionError, match="shape"):
        diagnose.assert_equal("x", torch.zeros(2), torch.zeros(3))
    diagnose.assert_rows("none bad", torch.zeros(5, dtype=torch.bool), "are bad")
    with pytest.raises(AssertionError, match=r"^map: slots 0, 4 \(2 of 5\) are bad; none of them has x \(1 of the 3"):
        diagnose.assert_rows("map", torch.tensor([1, 0, 0, 0, 1]).bool(), "are bad", row="slot",
                             facts={"x": torch.tensor([0, 1, 0, 0, 0])})
    with pytest.raises(ValueError, match="facts"):
        diagnose.describe(torch.ones(3, dtype=torch.bool), {"x": torch.ones(4, dtype=torch.bool)})

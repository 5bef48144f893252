"""``python -m moelab.bench``: one MoE layer forward, moelab beside its peers and the roofline (the full text is
``moelab.bench.cli``'s, shown by ``help(moelab.bench)`` and ``python -m moelab.bench --help``)."""

from moelab.bench import cli
from moelab.bench.cli import build_parser, main, run
from moelab.bench.report import failures, markdown
from moelab.roofline import (
    H200_CEILINGS,
    SHAPES,
    Ceilings,
    Shape,
    expected_touched_experts,
    get_shape,
    measure_ceilings,
    roofline,
)

__all__ = ["run", "main", "build_parser", "failures", "markdown", "Shape", "SHAPES", "Ceilings", "H200_CEILINGS",
           "get_shape", "measure_ceilings", "roofline", "expected_touched_experts"]

__doc__ = cli.__doc__

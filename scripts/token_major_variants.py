"""``scripts/host_cost.py`` on one variant of the token-major path's choices, for A/Bs on a GPU in one device call.

    python scripts/token_major_variants.py slots=0 -- --layers 4 --tokens 1 --shape qwen3-30b-a3b
    python scripts/token_major_variants.py lora_min_slots=1 -- --layers 4 --tokens 1 --lora 16
    python scripts/token_major_variants.py mixtral=unpipelined -- --layers 4 --tokens 1 --shape mixtral
    python scripts/token_major_variants.py pdl=1 -- --layers 4 --tokens 1 --shape mixtral

Each ``name=value`` of the comma list overrides one choice before host_cost runs (nothing given: HEAD's rule;
``beside=0|1`` and ``fused_shrink=0|1``, the LoRA shrink as a launch of its own, lived until 69f4d6d, and
``early_b=0|1`` at c84b30f: check those commits out to run them):

- ``slots=N`` and ``lora_slots=N``: ``TOKEN_MAJOR_MAX_SLOTS_GRAPH`` and ``..._LORA`` of the triton backend (the
  most slots a CUDA graph runs on the token-major path, without and with a bank); ``lora_min_slots=N``:
  ``TOKEN_MAJOR_MIN_SLOTS_GRAPH_LORA`` (the fewest, with a bank);
- ``mixtral=unpipelined``: large experts of K <= 4 (Mixtral's) take the unpipelined tiles of 2026-12-02 (GEMM1
  16 x 1024, 8 warps; GEMM2 8 x 512, 8 warps) instead of the pipelined ones of the other shapes;
- ``pdl=0|1``: ``TokenMajorConfig.pdl`` on every shape (1: programmatic dependent launch in graphs, as the rule
  chooses on every shape but Mixtral's).
"""

from __future__ import annotations

import dataclasses
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelab.backends import triton_backend  # noqa: E402
from moelab.kernels import token_major  # noqa: E402
from moelab.permutation import next_pow2  # noqa: E402


def apply(variant: str) -> None:
    """Set each ``name=value`` of ``variant`` (module docstring)."""
    chosen = dict(item.split("=", 1) for item in variant.split(",") if item)
    unknown = set(chosen) - {"slots", "lora_slots", "lora_min_slots", "mixtral", "pdl"}
    if unknown:
        raise ValueError(f"variant: unknown names {sorted(unknown)}; see this script's docstring")
    rule = token_major.choose_token_major_config.__wrapped__

    def choose(num_tokens: int, top_k: int, hidden: int, inter: int) -> token_major.TokenMajorConfig:
        cfg = rule(num_tokens, top_k, hidden, inter)
        if chosen.get("mixtral") == "unpipelined" and hidden >= 4096 and top_k <= 4:
            cfg = token_major.TokenMajorConfig(16, 1024, 8, 8, min(512, next_pow2(inter)), 8)
        if "pdl" in chosen:
            cfg = dataclasses.replace(cfg, pdl=chosen["pdl"] == "1")
        return cfg

    token_major.choose_token_major_config = choose
    if "slots" in chosen:
        triton_backend.TOKEN_MAJOR_MAX_SLOTS_GRAPH = int(chosen["slots"])
    if "lora_slots" in chosen:
        triton_backend.TOKEN_MAJOR_MAX_SLOTS_GRAPH_LORA = int(chosen["lora_slots"])
    if "lora_min_slots" in chosen:
        triton_backend.TOKEN_MAJOR_MIN_SLOTS_GRAPH_LORA = int(chosen["lora_min_slots"])


if __name__ == "__main__":
    if "--" not in sys.argv:
        raise SystemExit(__doc__)
    split = sys.argv.index("--")
    apply(",".join(sys.argv[1:split]))
    sys.argv = ["host_cost.py", *sys.argv[split + 1:]]
    runpy.run_path(str(Path(__file__).resolve().parent / "host_cost.py"), run_name="__main__")

"""Expert parallelism on ``torch.distributed``: experts spread over ranks, with LoRA and EPLB.

    ExpertParallelMoE          one MoE layer over a process group (two dispatch modes, LoRA, redundant experts)
    rebalance_experts          DeepSeek's EPLB: replicate hot experts and place copies by measured load
    ExpertParallelMetadata     one layer's placement under vLLM's names (num_logical_experts, expert_map, ...)
    check_expert_map, replica_maps, default_expert_map   placement helpers
    spawn_ranks, init_from_env start R local ranks (gloo/NCCL), or join torchrun's group

End a group with ``dist.destroy_process_group()`` on every rank (``spawn_ranks`` does it for its ranks). A layer
holds its group weakly, so that call ends it. A gloo group still alive when the interpreter exits can abort the
rank there ("terminate called without an active exception"): a gloo worker thread that frees the last
collective's tensors needs the GIL, which the exiting interpreter refuses.

``import moelab`` does not import this package; ``moelab.distributed`` (attribute access) or
``import moelab.distributed`` does.
"""

from moelab.distributed.eplb import rebalance_experts
from moelab.distributed.expert_parallel import DISPATCH_MODES, ExpertParallelMoE
from moelab.distributed.launch import init_from_env, spawn_ranks
from moelab.distributed.metadata import ExpertParallelMetadata, check_expert_map, default_expert_map, replica_maps

__all__ = ["ExpertParallelMoE", "DISPATCH_MODES", "rebalance_experts", "ExpertParallelMetadata", "check_expert_map",
           "default_expert_map", "replica_maps", "spawn_ranks", "init_from_env"]

"""Run a function on R local processes joined in a ``torch.distributed`` group (gloo on the CPU, NCCL on GPUs).

Tests, the benchmark's tiny CPU run and notebook 09 start their ranks with :func:`spawn_ranks`; under ``torchrun``
:func:`init_from_env` joins the group torchrun set up instead. Nothing here hangs: collectives time out after
``timeout`` seconds, and the parent stops every rank that has not finished by then.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn_ranks", "init_from_env", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _rank_main(rank, fn, world_size, port, backend, timeout, out_dir, args):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:  # ends the group before the interpreter exits (moelab.distributed's docstring says why)
        dist.destroy_process_group()


def spawn_ranks(fn, world_size: int, *args, device: str = "cpu", timeout: float = 60.0,
                env: dict[str, str] | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes in one process group; return each
    rank's return value (saved with ``torch.save``), in rank order.

    ``fn`` must be importable by name (a module-level function: the processes are spawned). ``device`` "cpu"
    joins them with gloo, "cuda" with NCCL (rank r on GPU r). ``timeout`` (seconds) bounds every collective and,
    twice over, the whole run: ranks still alive then are terminated and a TimeoutError is raised. An exception
    in any rank is raised here with that rank's traceback. ``env``: environment variables the new processes
    start with (e.g. ``{"TRITON_INTERPRET": "0"}``: moelab's torch backend in plain torch on a CPU).

    Example (``my_module.rank_sum``: ``def rank_sum(rank, world_size): t = torch.tensor([rank]);
    dist.all_reduce(t); return t.item()``):
        >>> spawn_ranks(my_module.rank_sum, 2)  # doctest: +SKIP
        [1, 1]
    """
    saved = {name: os.environ.get(name) for name in env or {}}
    with tempfile.TemporaryDirectory(prefix="moelab-ranks-") as out_dir:
        try:
            os.environ.update(env or {})  # spawned processes start with a copy of this environment
            context = mp.start_processes(_rank_main, args=(fn, world_size, free_port(), _backend_for(device),
                                                           timeout, out_dir, args),
                                         nprocs=world_size, join=False, start_method="spawn")
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = value
        deadline = time.monotonic() + 2 * timeout + 30  # + start-up: importing torch in each process
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"spawn_ranks: {fn.__name__} on {world_size} ranks did not finish within "
                                       f"{2 * timeout + 30:.0f} s (a collective that never completes?)")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                    process.join(5)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def init_from_env(timeout: float = 60.0) -> tuple[int, int]:
    """Join the group ``torchrun`` describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); NCCL when CUDA is
    available, else gloo. Returns (rank, world_size)."""
    backend = _backend_for("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()

"""Run a function as the ranks of a real ``torch.distributed`` group (gloo, spawned processes).

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes (spawn: never fork after
torch has run), each joins one gloo group and calls ``fn(rank, *args)``; the return values come back
in rank order (pickled through files). ``fn`` must be importable by name (a module-level function).
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from sluice.trainer.rendezvous import free_tcp_address


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    with tempfile.TemporaryDirectory() as tmp:
        address = free_tcp_address()
        mp.start_processes(
            _rank_main, args=(fn, world_size, address, tmp, args), nprocs=world_size, start_method="spawn"
        )
        return [pickle.loads((Path(tmp) / f"{rank}.pkl").read_bytes()) for rank in range(world_size)]


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, address: str, tmp: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a collective the ranks do not all reach fails in 2 minutes instead of hanging
    dist.init_process_group(
        "gloo", init_method=address, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        result = fn(rank, *args)
        (Path(tmp) / f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()

"""Memory and step time of the trainer's strategies and compute dtypes (``training.py strategies``).

For 1 and 2 ranks × {``ddp``, ``fsdp2``} (gloo on CPU, spawned processes, one thread each) and
for ``single`` in float32 vs bfloat16: the default task's tiny model shape, or a wider one, trains
GRPO steps on the same synthetic groups (each rank its share); after the first step each rank sums
the bytes it holds locally of parameters, gradients and optimizer state (a sharded tensor's local
shard), and the median time of the later steps is the step time. Deliberately not a test: the
numbers are printed and written as JSON, never asserted.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from harness.ranks import run_ranks
from sluice.api.types import Sample
from sluice.engines.hf_train import HFTrainEngine
from sluice.tasks import TASKS
from sluice.tasks.spec import TinyLlamaSpec
from sluice.tasks.tiny_model import build_char_tokenizer, build_tiny_llama
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.step import plan_step, run_step, step_normaliser

SHAPES = {
    "tiny": TASKS["reverse_digits"].model,
    "wide": TinyLlamaSpec(
        hidden_size=768,
        num_hidden_layers=4,
        num_attention_heads=12,
        num_key_value_heads=12,
        intermediate_size=2048,
        max_position_embeddings=128,
    ),
}


def _model(shape: str) -> torch.nn.Module:
    task = TASKS["reverse_digits"]
    return build_tiny_llama(SHAPES[shape], build_char_tokenizer(task.alphabet), seed=0)


def local_bytes(engine: HFTrainEngine) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards)."""
    from torch.distributed.tensor import DTensor

    def size(t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = list(engine.model.parameters())
    optimizer = sum(size(v) for state in engine.optimizer.state.values() for v in state.values())
    return {
        "param_bytes": sum(size(p) for p in params),
        "grad_bytes": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": optimizer,
    }


def train_rank(rank: int, world: int, strategy: str, shape: str, dtype: str, steps: list[list[Sample]]) -> dict:
    """One rank's row: local bytes after the first step, median time of the later steps."""
    engine = HFTrainEngine(_model(shape), lr=1e-4, dtype=getattr(torch, dtype))
    if strategy != "single":
        engine.distribute(strategy)
    algorithm = GRPOAlgorithm()
    times, held = [], {}
    for k, samples in enumerate(steps):
        mine = [s for s in samples if s.group_id % world == rank]
        start = time.perf_counter()
        run_step(engine, plan_step(mine, algorithm, 2048), algorithm, step_normaliser(samples, algorithm))
        times.append(time.perf_counter() - start)
        if k == 0:
            held = local_bytes(engine)
    return {**held, "step_s": statistics.median(times[1:] or times)}


def measure(shape: str, steps: list[list[Sample]]) -> list[dict[str, Any]]:
    """Rows: {strategy, ranks, dtype, bytes per rank (the largest rank's), step time}."""
    cases = [("single", 1, "float32"), ("ddp", 1, "float32"), ("ddp", 2, "float32"), ("fsdp2", 1, "float32"),
             ("fsdp2", 2, "float32"), ("single", 1, "bfloat16")]  # fmt: skip
    rows = []
    for strategy, world, dtype in cases:
        ranks = run_ranks(train_rank, world, world, strategy, shape, dtype, steps)
        worst = max(ranks, key=lambda r: r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"])
        total = worst["param_bytes"] + worst["grad_bytes"] + worst["optimizer_bytes"]
        rows.append({"shape": shape, "strategy": strategy, "ranks": world, "dtype": dtype, **worst,
                     "bytes_per_rank": total, "step_s": max(r["step_s"] for r in ranks)})  # fmt: skip
    base = rows[0]["bytes_per_rank"]
    for row in rows:
        row["vs_single"] = round(row["bytes_per_rank"] / base, 3)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'shape':<6} {'strategy':<8} {'ranks':>5} {'dtype':<9} {'params MiB':>10} {'grads MiB':>9} "
          f"{'optim MiB':>9} {'total MiB':>9} {'vs single':>9} {'step s':>7}")  # fmt: skip
    mib = 1 << 20
    for r in rows:
        print(f"{r['shape']:<6} {r['strategy']:<8} {r['ranks']:>5} {r['dtype']:<9} {r['param_bytes'] / mib:>10.2f} "
              f"{r['grad_bytes'] / mib:>9.2f} {r['optimizer_bytes'] / mib:>9.2f} {r['bytes_per_rank'] / mib:>9.2f} "
              f"{r['vs_single']:>8.2f}x {r['step_s']:>7.3f}")  # fmt: skip

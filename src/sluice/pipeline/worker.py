"""A DAG worker (DistFlow §5): one process that owns a chain of node functions and moves its own data.

Every step, for each node of its chain, the worker fetches its shard of the step's rows from the
TransferQueue by data-parallel rank (``get(node, reads, partition=step, shard=Shard(rank,
parallel))``: the queue's redistribution between nodes of different sizes), runs the function and
writes the outputs back to the same rows. A worker of a ``generate`` node instead takes admission
credits from the gate, reads prompts from its own shard of the dataset (``loader.py``) and writes
new rows into the step's partition. Metrics go many-to-one to rank 0 of the worker group, which
the driver asks once. The single-controller variant (``runtime.py``) drives the same worker
through ``apply`` / ``produce``, passing rows by value.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.api import Batch, Partition, RowMeta, Shard
from sluice.pipeline.functions import NodeContext, apply_node, resolve_function
from sluice.pipeline.loader import PromptSource, ShardLoader
from sluice.pipeline.planner import Plan
from sluice.pipeline.spec import DagError


@dataclass(frozen=True)
class RuntimeSettings:
    """What every worker of a run needs besides the plan (picklable, small)."""

    groups_per_step: int
    group_size: int
    steps: int
    prompts: PromptSource
    max_staleness: int = 0
    grants_per_call: int = 0
    """Credits a generate worker asks for at once (0: its share of a step)."""
    timeout_s: float = 600.0
    """How long a worker waits for a step's rows before the run fails."""

    @property
    def rows_per_step(self) -> int:
        return self.groups_per_step * self.group_size


class DagWorker:
    """Rank ``rank`` of worker group ``group`` of ``plan``; ``queue`` is a blocking queue client."""

    def __init__(
        self, plan: Plan, group: str, rank: int, settings: RuntimeSettings, queue: Any, gate: Any, models: Any = None
    ) -> None:
        spec = plan.spec
        members = next(g for g in plan.groups if g.name == group)
        self.rank, self.size, self.settings, self.queue, self.gate = rank, members.size, settings, queue, gate
        self.nodes = [spec.node(n) for n in members.nodes if rank < spec.node(n).parallel]
        generates = [n for n in spec.nodes if n.type == "generate" and n.id in members.nodes]
        if generates and len(members.nodes) > 1:
            raise DagError(
                f"node {generates[0].id!r}: the multi-controller runtime runs a generate node alone in its pool"
            )
        self.functions = {n.id: resolve_function(n) for n in self.nodes}
        self.contexts = {n.id: NodeContext(n, rank, n.parallel, models=models) for n in self.nodes}
        self.loader = ShardLoader(settings.prompts, rank, generates[0].parallel) if generates and self.nodes else None
        self.rank0: Any = None
        self._reports: dict[int, list[dict[str, float]]] = {}
        self._lock = threading.Lock()
        self.trained: list[tuple[int, int, int]] = []  # (step, row, row version) of every row read
        self.phase_s: dict[str, float] = {}

    @property
    def generates(self) -> bool:
        return self.loader is not None

    def connect(self, rank0: Any) -> None:
        """Rank 0 of this group, where metrics are aggregated (``None`` on rank 0 itself)."""
        self.rank0 = rank0

    # -- multi-controller: the worker runs the whole loop itself ------------------------------

    def run(self) -> int:
        """Generate until the gate has no more credits, or consume every step; returns rows handled."""
        return self._run_generate() if self.generates else self._run_consume()

    def _run_generate(self) -> int:
        node, s = self.nodes[0], self.settings
        per_call = s.grants_per_call or max(1, s.groups_per_step // node.parallel)
        rows = 0
        clock = time.perf_counter()
        while grants := _ray_get(self.gate.acquire.remote(per_call, s.timeout_s)):
            clock = self._phase("acquire_s", clock)
            indices, columns, meta = self.produce(grants)
            clock = self._phase("produce_s", clock)
            for step in sorted({m.partition for m in meta}):  # one put per partition the grants span
                pick = [k for k, m in enumerate(meta) if m.partition == step]
                part = {c: take_rows(v, pick) for c, v in columns.items()}
                self.queue.put(
                    [indices[k] for k in pick],
                    part,
                    [meta[k] for k in pick],
                    partition=Partition(step, s.rows_per_step),
                )
            clock = self._phase("put_s", clock)
            rows += len(indices)
        return rows

    def _phase(self, name: str, since: float) -> float:
        """Add the time since ``since`` to phase ``name``; returns now."""
        now = time.perf_counter()
        self.phase_s[name] = self.phase_s.get(name, 0.0) + now - since
        return now

    def phases(self) -> dict[str, float]:
        """Seconds this worker spent per phase (waiting for rows or credits, computing, writing)."""
        return dict(self.phase_s)

    def _run_consume(self) -> int:
        rows = 0
        for step in range(self.settings.steps):
            metrics: dict[str, float] = {}
            for node in self.nodes:
                clock = time.perf_counter()
                batch = self.queue.get(
                    node.id,
                    node.reads,
                    self.settings.rows_per_step,
                    partition=step,
                    shard=Shard(self.rank, node.parallel),
                    timeout=self.settings.timeout_s,
                )
                if not len(batch):
                    raise TimeoutError(f"node {node.id!r} rank {self.rank}: no rows of step {step} within the timeout")
                clock = self._phase(f"{node.id}_wait_s", clock)
                batch = sorted_batch(batch)
                self.trained.extend((step, m.index, m.version) for m in batch.meta)
                out = self.apply(node.id, step, batch)
                clock = self._phase(f"{node.id}_compute_s", clock)
                if out:
                    self.queue.put(list(batch.indices), out)
                self._phase(f"{node.id}_put_s", clock)
                metrics.update(self.contexts[node.id].metrics)
                rows += len(batch)
            self.report(step, self.rank, metrics)
            _ray_get(self.gate.step_done.remote(step))
        return rows

    # -- the pieces (also what the single-controller variant calls) ----------------------------

    def produce(self, grants: Sequence[tuple[int, int]]) -> tuple[list[int], dict[str, Any], list[RowMeta]]:
        """Generate the groups of ``grants`` ``(group sequence, version)`` from this shard's prompts:
        their rows' indices, columns and metadata (partition = the group's step)."""
        assert self.loader is not None
        node, s = self.nodes[0], self.settings
        ctx = self.contexts[node.id]
        groups = [g for g, _ in grants]
        ctx.version = min(v for _, v in grants)
        prompt_rows = Batch(tuple(groups), {"prompt": self.loader.take(len(groups))}, tuple(
            RowMeta(g, g, v, 0) for g, v in grants
        ))  # fmt: skip
        columns = apply_node(self.functions[node.id], ctx, prompt_rows, len(groups) * s.group_size)
        tokens = _row_tokens(columns[node.writes[0]])
        indices, meta = [], []
        for k, (g, v) in enumerate(grants):
            for j in range(s.group_size):
                row = g * s.group_size + j
                indices.append(row)
                step = g // s.groups_per_step
                meta.append(RowMeta(row, g, v, int(tokens[k * s.group_size + j]), s.group_size, step))
        return indices, columns, meta

    def apply(self, node_id: str, step: int, batch: Batch) -> dict[str, Any]:
        """Run node ``node_id`` on ``batch`` (rows in ascending order) for ``step``."""
        ctx = self.contexts[node_id]
        ctx.step, ctx.metrics = step, {}
        ctx.version = min((m.version for m in batch.meta), default=ctx.version)
        return apply_node(self.functions[node_id], ctx, batch, len(batch))

    def report(self, step: int, rank: int, metrics: dict[str, float]) -> None:
        """Rank 0 keeps every rank's metrics of ``step``; other ranks forward theirs to it."""
        if self.rank0 is not None:
            _ray_get(self.rank0.report.remote(step, rank, metrics))
            return
        with self._lock:
            self._reports.setdefault(step, []).append(metrics)

    def aggregated(self) -> dict[int, dict[str, float]]:
        """Rank 0: per step, every metric averaged over the ranks that reported it, plus ``ranks``."""
        with self._lock:
            out = {}
            for step, parts in sorted(self._reports.items()):
                keys = {k for p in parts for k in p}
                out[step] = {k: sum(p[k] for p in parts if k in p) / sum(k in p for p in parts) for k in keys}
                out[step]["ranks"] = float(len(parts))
            return out

    def warm_up(self, partition_base: int) -> None:
        """Send one tiny row per node of this chain through its shard read, in a partition of its own
        that no step reads, so the queue's one-time costs (its controllers load the shard balancer)
        are paid before a timed run."""
        for k, node in enumerate(self.nodes):
            if node.type == "generate":
                continue
            pid = partition_base + k
            self.queue.put(
                [pid], {c: [0] for c in node.reads}, [RowMeta(pid, pid, 0, 1, 1, pid)], partition=Partition(pid, 1)
            )
            self.queue.get(node.id, node.reads, 1, partition=pid, shard=Shard(0, 1), timeout=self.settings.timeout_s)

    def cursor(self) -> dict[str, int] | None:
        """The data-loader cursor of a generate worker (one per shard)."""
        return self.loader.cursor() if self.loader is not None else None

    def rows_seen(self) -> list[tuple[int, int, int]]:
        return list(self.trained)


def _ray_get(ref: Any) -> Any:
    import ray

    return ray.get(ref)


def sorted_batch(batch: Batch) -> Batch:
    """``batch`` with its rows in ascending index order (what node functions get)."""
    order = sorted(range(len(batch)), key=lambda k: batch.indices[k])
    if order == list(range(len(batch))):
        return batch
    return Batch(
        tuple(batch.indices[k] for k in order),
        {c: take_rows(v, order) for c, v in batch.columns.items()},
        tuple(batch.meta[k] for k in order),
        batch.done,
    )


def take_rows(values: Sequence[Any], positions: Sequence[int]) -> Any:
    from sluice.queue.packed import PackedColumn, gather

    if isinstance(values, PackedColumn):
        return gather([(values, p) for p in positions], values)
    return [values[p] for p in positions]


def _row_tokens(column: Sequence[Any]) -> np.ndarray:
    from sluice.queue.packed import PackedColumn

    if isinstance(column, PackedColumn):
        return column.lengths()  # elements, or bytes for tensor rows: only relative sizes matter
    return np.array([len(v) if hasattr(v, "__len__") else 1 for v in column], dtype=np.int64)

"""Running a compiled DAG on Ray: the multi-controller driver, and the single-controller variant.

``MultiControllerRun`` (DistFlow): the driver creates the TransferQueue, the admission gate and
one ``DagWorker`` actor per worker of each group, then sends each worker one control message,
``run``. Workers fetch and write their own rows through the queue, take credits from the gate,
report metrics to their group's rank 0; the driver finally asks each rank 0 for its aggregate.
``SingleControllerRun`` is the design DistFlow measures against: the driver admits each step's
groups, gathers every generated row, scatters each node's shards to its workers by value and
gathers their outputs back. Both talk to Ray only through a ``DriverTransport`` that counts the
bytes. Neither decides what a node computes.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distflow.gate import ServedGate
from distflow.transport import DriverBytes, DriverTransport
from distflow.worker import WARM_SPAN, DagWorker, RuntimeSettings
from sluice.api import Batch, RowMeta
from sluice.dag.planner import Plan, WorkerGroup

WARM_PARTITIONS = 1 << 40
"""Partition ids from here on carry ``ready``'s warm-up rows (no step ever reads them)."""


@dataclass(frozen=True)
class DagRunResult:
    metrics: dict[str, dict[int, dict[str, float]]]
    """Per worker group, per step: rank 0's aggregate of its ranks' metrics."""
    rows: int
    """Rows handled by all workers (generated + read)."""
    driver: DriverBytes
    gate: dict[str, int]
    cursors: list[dict[str, int]]
    """The data-loader cursor of each generate worker (one per prompt shard)."""


class _Run(ABC):
    def __init__(self, plan: Plan, settings: RuntimeSettings, *, storage_units: int = 1, models: Any = None) -> None:
        import ray

        from sluice.queue import RayQueue

        if not ray.is_initialized():
            raise RuntimeError("ray.init() first")
        self.plan, self.settings = plan, settings
        self.transport = DriverTransport(frozenset(c for n in plan.spec.nodes for c in (*n.reads, *n.writes)))
        self.queue = RayQueue.create(storage_units, tasks=plan.queue_tasks())
        consumers = sum(g.size for g in plan.groups if not self._generates(g))
        gate_cls: Any = ray.remote(ServedGate).options(num_cpus=0, max_concurrency=64)
        args = (settings.groups_per_step, settings.max_staleness, settings.steps, consumers)
        self.gate = self.transport.call(gate_cls, *args)
        workers = sum(g.size for g in plan.groups)
        share = min(1.0, ray.cluster_resources().get("CPU", 1.0) / workers)
        env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        self.workers: dict[str, list[Any]] = {}
        for group in plan.groups:
            worker_cls: Any = ray.remote(DagWorker).options(
                num_cpus=min(group.cpus, share),
                num_gpus=group.devices,
                max_concurrency=4,
                runtime_env={"env_vars": env},
            )
            self.workers[group.name] = [
                self.transport.call(worker_cls, plan, group.name, r, settings, self.queue, self.gate, models)
                for r in range(group.size)
            ]

    def ready(self) -> None:
        """Wait until every actor (workers, gate, the queue's units and controllers) is up and
        every worker knows its rank 0, then warm the variant's data path, so a timed ``run``
        measures the data path, not process start-up or first connections."""
        t = self.transport
        t.get([t.call(a.phases) for actors in self.workers.values() for a in actors] + [t.call(self.gate.stats)])
        self.queue.stats()
        for actors in self.workers.values():
            t.get([t.call(a.connect, actors[0] if r else None) for r, a in enumerate(actors)])
        self._warm_up()

    @abstractmethod
    def _warm_up(self) -> None:
        """Pay the variant's one-time data-path costs before a timed ``run``."""

    def _generates(self, group: WorkerGroup) -> bool:
        return any(self.plan.spec.node(n).type == "generate" for n in group.nodes)

    def _result(self, rows: int) -> DagRunResult:
        t = self.transport
        metrics = {name: t.get(t.call(actors[0].aggregated)) for name, actors in self.workers.items()}
        generators = [a for g in self.plan.groups if self._generates(g) for a in self.workers[g.name]]
        cursors = t.get([t.call(a.cursor) for a in generators])
        return DagRunResult(metrics, rows, t.counts, t.get(t.call(self.gate.stats)), cursors)

    def close(self) -> None:
        import ray

        ray.get([a.close_transport.remote() for actors in self.workers.values() for a in actors])
        ray.get(self.gate.close_transport.remote())
        for actors in self.workers.values():
            for actor in actors:
                ray.kill(actor)
        ray.kill(self.gate)
        self.queue.shutdown()


class MultiControllerRun(_Run):
    """Every worker runs its own loop; the driver sends ``run`` once per worker and reads metrics."""

    def _warm_up(self) -> None:
        """Each worker's queue path (units, outbox, shard reads), gate and rank-0 connections."""
        t, units = self.transport, len(self.queue.units)
        bases = [WARM_PARTITIONS + WARM_SPAN * k for k in range(len(self.workers))]
        t.get([
            t.call(a.warm_up, base, units)
            for actors, base in zip(self.workers.values(), bases, strict=True)
            for a in actors
        ])  # fmt: skip

    def run(self) -> DagRunResult:
        t = self.transport
        rows = sum(t.get([t.call(a.run) for actors in self.workers.values() for a in actors]))
        return self._result(rows)


class SingleControllerRun(_Run):
    """The driver moves every row: it gathers each step's generated rows, then per node scatters
    the rows' shards to the node's workers and gathers their outputs (the same node functions)."""

    def _warm_up(self) -> None:
        """Ray's by-value path to and from each worker, with a buffer as big as a warm-up row."""
        import numpy as np

        from distflow.worker import WARM_ROW_BYTES

        t = self.transport
        payload = np.zeros(WARM_ROW_BYTES, dtype=np.uint8)
        t.get([t.call(a.round_trip, payload) for actors in self.workers.values() for a in actors])

    def run(self) -> DagRunResult:
        t, s = self.transport, self.settings
        spec = self.plan.spec
        rows = 0
        generator = next(g for g in self.plan.groups if self._generates(g))
        makers = self.workers[generator.name]
        for step in range(s.steps):
            grants = [(step * s.groups_per_step + k, step) for k in range(s.groups_per_step)]
            parts = [
                grants[r * len(grants) // len(makers) : (r + 1) * len(grants) // len(makers)]
                for r in range(len(makers))
            ]
            made = t.get([t.call(w.produce, p) for w, p in zip(makers, parts, strict=True) if p])
            indices = [i for part in made for i in part[0]]
            meta: list[RowMeta] = [m for part in made for m in part[2]]
            # every column as (worker's part, row) cells: each shard is gathered once, straight
            # from the parts the workers returned (no intermediate whole-batch copy)
            cells = {c: _cells([part[1][c] for part in made]) for c in made[0][1]}
            for node_id in self.plan.order():
                node = spec.node(node_id)
                if node.type == "generate":
                    continue
                group = self.workers[next(g for g in self.plan.groups if node_id in g.nodes).name]
                shards = [range(r * len(indices) // node.parallel, (r + 1) * len(indices) // node.parallel)
                          for r in range(node.parallel)]  # fmt: skip
                batches = [
                    Batch(tuple(indices[k] for k in sh), {c: pick(cells[c], sh) for c in node.reads},
                          tuple(meta[k] for k in sh))
                    for sh in shards
                ]  # fmt: skip
                outs = t.get([t.call(group[r].apply, node_id, step, b) for r, b in enumerate(batches)])
                for c in node.writes:
                    cells[c] = _cells([o[c] for o in outs])
                rows += len(indices)
            rows += len(indices)
        return self._result(rows)


def _cells(parts: list[Any]) -> list[tuple[Any, int]]:
    """Consecutive parts of a column as one ``(part, row)`` per row."""
    return [(p, k) for p in parts for k in range(len(p))]


def pick(cells: list[tuple[Any, int]], positions: Sequence[int]) -> Any:
    """The rows at ``positions`` of a column held as cells: packed parts gathered in one copy."""
    from sluice.queue.packed import PackedColumn, gather

    chosen = [cells[p] for p in positions]
    if chosen and all(isinstance(part, PackedColumn) and part.compatible(chosen[0][0]) for part, _ in chosen):
        return gather(chosen, chosen[0][0])
    return [part[k] for part, k in chosen]

"""A DAG worker (DistFlow §5): one process that owns a chain of node functions and moves its own data.

Every step, for each node of its chain, the worker fetches its shard of the step's rows from the
TransferQueue by data-parallel rank (``get(node, reads, partition=step, shard=Shard(rank,
parallel))``: the queue's redistribution between nodes of different sizes), runs the function and
writes the outputs back to the same rows. A worker of a ``generate`` node instead takes admission
credits from the gate, reads prompts from its own shard of the dataset (``loader.py``) and writes
new rows into the step's partition. Metrics go many-to-one to rank 0 of the worker group, which
the driver asks once. Credits, step reports and metrics are control calls to the gate and to
rank 0 (``peer.py``: over a Unix socket on one node); sample bytes only ever go through the queue.
The single-controller variant (``runtime.py``) drives the same worker through ``apply`` /
``produce``, passing rows by value.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from distflow.peer import Peer, endpoint_of
from sluice.api import Batch, Partition, RowMeta, Shard
from sluice.dag.functions import NodeContext, apply_node, resolve_function
from sluice.dag.loader import PromptSource, ShardLoader
from sluice.dag.planner import Plan
from sluice.dag.spec import DagError, DagNode
from sluice.queue.storage import PLACEMENT_BLOCK


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


WARM_ROW_BYTES = 256 * 1024
"""Size of a warm-up row: above the queue's shared-memory threshold, so ``warm_up`` opens its arenas."""
WARM_NODE_ROWS = 1 << 24
"""``warm_up`` row ids: the puts' rows from its base on, each consuming node's reads' rows this far apart."""
WARM_SPAN = 1 << 32
"""Row and partition ids of one worker group's ``warm_up`` (256 nodes' worth)."""


class DagWorker:
    """Rank ``rank`` of worker group ``group`` of ``plan``; ``queue`` is a blocking queue client,
    ``gate`` the ``ServedGate`` actor."""

    DIRECT_METHODS = ("report", "phases")

    def __init__(
        self, plan: Plan, group: str, rank: int, settings: RuntimeSettings, queue: Any, gate: Any, models: Any = None
    ) -> None:
        spec = plan.spec
        members = next(g for g in plan.groups if g.name == group)
        self.rank, self.size, self.settings, self.queue = rank, members.size, settings, queue
        self.gate = Peer(gate)
        self.nodes = [spec.node(n) for n in members.nodes if rank < spec.node(n).parallel]
        generates = [n for n in spec.nodes if n.type == "generate" and n.id in members.nodes]
        if generates and len(members.nodes) > 1:
            raise DagError(
                f"node {generates[0].id!r}: the multi-controller runtime runs a generate node alone in its pool"
            )
        self.functions = {n.id: resolve_function(n) for n in self.nodes}
        self.contexts = {n.id: NodeContext(n, rank, n.parallel, models=models) for n in self.nodes}
        self.loader = ShardLoader(settings.prompts, rank, generates[0].parallel) if generates and self.nodes else None
        self.rank0: Peer | None = None
        self._server: Any = None  # rank 0's socket for its ranks' reports (``endpoint``)
        self._reports: dict[int, list[dict[str, float]]] = {}
        self._lock = threading.Lock()
        self.trained: list[tuple[int, int, int]] = []  # (step, row, row version) of every row read
        self.phase_s: dict[str, float] = {}

    @property
    def generates(self) -> bool:
        return self.loader is not None

    def connect(self, rank0: Any) -> None:
        """Rank 0 of this group, where metrics are aggregated (``None`` on rank 0 itself)."""
        self.rank0 = None if rank0 is None else Peer(rank0)

    def endpoint(self) -> tuple[str, str]:
        """Where same-node ranks call ``report`` (a socket served from the first ask on)."""
        with self._lock:
            if self._server is None:
                from sluice.queue.direct import DirectServer

                self._server = DirectServer(self)
        return endpoint_of(self._server)

    # -- multi-controller: the worker runs the whole loop itself ------------------------------

    def run(self) -> int:
        """Generate until the gate has no more credits, or consume every step; returns rows handled."""
        return self._run_generate() if self.generates else self._run_consume()

    def _run_generate(self) -> int:
        node, s = self.nodes[0], self.settings
        per_call = s.grants_per_call or max(1, s.groups_per_step // node.parallel)
        rows = 0
        clock = time.perf_counter()
        while grants := self.gate.call("acquire", per_call, s.timeout_s):
            clock = self._phase("acquire_s", clock)
            indices, columns, meta = self.produce(grants)
            clock = self._phase("produce_s", clock)
            steps = sorted({m.partition for m in meta})
            for step in steps:  # one put per partition the grants span
                pick = [k for k, m in enumerate(meta) if m.partition == step]
                whole = len(steps) == 1  # all rows: put the columns as they are, no copy
                self.queue.put(
                    indices if whole else [indices[k] for k in pick],
                    columns if whole else {c: take_rows(v, pick) for c, v in columns.items()},
                    meta if whole else [meta[k] for k in pick],
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
                rows += self._consume(node, step)
                metrics.update(self.contexts[node.id].metrics)
            self.gate.call("step_done", step)  # first: the next step's credits wait for it
            self.report(step, self.rank, metrics)
        return rows

    def _consume(self, node: DagNode, step: int) -> int:
        """Read this rank's shard of ``step`` for ``node``, run it, write its outputs; rows read.

        On one node the rows are views of the queue's shared memory (``get_views``: no copy out)
        until the outputs are written, so a function's outputs may be its inputs' rows."""
        clock = time.perf_counter()
        with self._read(node, step) as batch:
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
        return len(batch)

    def _read(self, node: DagNode, step: int) -> AbstractContextManager[Batch]:
        """This rank's shard of ``step``'s rows for ``node``: the queue's own redistribution."""
        s, shard = self.settings, Shard(self.rank, node.parallel)
        args = (node.id, node.reads, s.rows_per_step)
        views = getattr(self.queue, "get_views", None)  # RayQueue's; any other client copies
        if views is not None:
            return views(*args, partition=step, shard=shard, timeout=s.timeout_s)  # type: ignore[no-any-return]
        return nullcontext(self.queue.get(*args, partition=step, shard=shard, timeout=s.timeout_s))

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
            self.rank0.call("report", step, rank, metrics)
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

    def warm_up(self, base: int, units: int) -> None:
        """Pay this worker's one-time data-path costs before a timed run, in rows no step reads:
        the connections to the gate, to rank 0 and to each of the queue's ``units`` storage units,
        this process's shared-memory outbox (a put of one big row to every unit, then cleared),
        and per consuming node one shard read per unit (its controller loads the shard balancer;
        this process maps every unit's arena). Rows live in blocks dealt round-robin over the
        units (``unit_of``), so rows ``units`` blocks apart share a unit and neighbouring blocks
        do not. ``base``: the group's first warm-up row and partition id (``WARM_SPAN`` ids from
        the next group's), the same on every rank (rank 0 writes what all ranks read)."""
        self.gate.call("stats")
        if self.rank0 is not None:
            self.rank0.call("phases")
        rows = [base + (self.rank * units + u) * PLACEMENT_BLOCK for u in range(units)]
        self.queue.put(rows, {"warm_up": _zeros(len(rows))})
        self.queue.clear(rows)
        for k, node in enumerate(self.nodes):
            if node.type == "generate":
                continue
            for u in range(units):  # one partition per unit, its rows all on that unit
                pid = base + k * units + u
                if self.rank == 0:
                    first = base + (k + 1) * WARM_NODE_ROWS + u * PLACEMENT_BLOCK
                    indices = [first + j * units * PLACEMENT_BLOCK for j in range(node.parallel)]
                    meta = [RowMeta(i, i, 0, 1, 1, pid) for i in indices]
                    columns = {c: _zeros(len(indices)) for c in node.reads}
                    self.queue.put(indices, columns, meta, partition=Partition(pid, len(indices)))
                shard = Shard(self.rank, node.parallel)
                self.queue.get(
                    node.id, node.reads, node.parallel, partition=pid, shard=shard, timeout=self.settings.timeout_s
                )

    def round_trip(self, payload: Any) -> Any:
        """``payload`` back: the single-controller variant's warm-up of Ray's by-value path."""
        return payload

    def close_transport(self) -> None:
        if self._server is not None:
            self._server.close()

    def cursor(self) -> dict[str, int] | None:
        """The data-loader cursor of a generate worker (one per shard)."""
        return self.loader.cursor() if self.loader is not None else None

    def rows_seen(self) -> list[tuple[int, int, int]]:
        return list(self.trained)


def _zeros(rows: int) -> Any:
    """``rows`` rows of ``WARM_ROW_BYTES`` zeros each, packed."""
    from sluice.queue.packed import PackedColumn, offsets_of

    per_row = WARM_ROW_BYTES // 4
    return PackedColumn(np.zeros(rows * per_row, dtype=np.int32), offsets_of([per_row] * rows), "list")


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

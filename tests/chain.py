"""Test helper: a chain of DAG nodes run one after another in this process, on one buffer.

Checks that the built-in node functions compute what the classic trainer functions compute.
``ColocatedChain.run`` turns a step's samples into rows, runs the
plan's nodes after generation in the planner's serial order — each sees only the columns it
reads, and its outputs join the buffer — and returns the nodes' metrics. Nothing crosses a
process here; the multi-controller runtime (``runtime.py``) runs the same node functions on
rows it reads from the TransferQueue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sluice.api import Batch, RowMeta, Sample
from sluice.dag.functions import NodeContext, apply_node, resolve_function
from sluice.dag.planner import Plan
from sluice.dag.spec import DagError
from sluice.queue.samples import samples_to_rows


class ColocatedChain:
    """Runs ``plan``'s non-``generate`` nodes in its serial order with the engines in ``models``."""

    def __init__(self, plan: Plan, models: Any) -> None:
        self.nodes = [plan.spec.node(n) for n in plan.order() if plan.spec.node(n).type != "generate"]
        self.functions = {n.id: resolve_function(n) for n in self.nodes}
        self.contexts = {n.id: NodeContext(n, models=models) for n in self.nodes}

    def run(self, samples: Sequence[Sample], group_size: int, step: int = 0) -> dict[str, float]:
        """One step over ``samples`` (whole groups, as generation wrote them); the nodes' metrics."""
        batch = samples_batch(samples, group_size)
        columns: dict[str, Sequence[Any]] = dict(batch.columns)
        metrics: dict[str, float] = {}
        for node in self.nodes:
            missing = [c for c in node.reads if c not in columns]
            if missing:
                raise DagError(f"node {node.id!r} reads {missing}, which nothing before it wrote")
            ctx = self.contexts[node.id]
            ctx.step, ctx.version, ctx.metrics = step, step, {}
            rows = Batch(batch.indices, {c: columns[c] for c in node.reads}, batch.meta)
            columns.update(apply_node(self.functions[node.id], ctx, rows, len(batch)))
            metrics.update(ctx.metrics)
        return metrics


def samples_batch(samples: Sequence[Sample], group_size: int) -> Batch:
    """``samples`` as queue rows (``group_id · group_size + k``), in ascending row order."""
    by_group: dict[int, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    indices: list[int] = []
    meta: list[RowMeta] = []
    columns: dict[str, list[Any]] = {}
    for gid in sorted(by_group):
        rows, cols, metas = samples_to_rows(by_group[gid], group_size)
        indices.extend(rows)
        meta.extend(metas)
        for name, values in cols.items():
            columns.setdefault(name, []).extend(values)
    return Batch(tuple(indices), dict(columns), tuple(meta))

"""Built-in ``compute`` node functions that need no model: combining columns.

Not here: the data-path benchmark's synthetic generator and checksum
(``benchmarks/distflow/data_nodes.py``; no run uses them).
"""

from __future__ import annotations

from sluice.api import Batch
from sluice.dag.functions import NodeContext
from sluice.dag.spec import DagError


def weighted_sum(ctx: NodeContext, rows: Batch) -> dict[str, list[float]]:
    """``Σ_i weights[i] · row[reads[i]]`` per row (``options.weights``, default all 1): e.g. two
    rewards combined into the one the advantages read."""
    reads = ctx.node.reads
    weights = [float(w) for w in ctx.options.get("weights", [1.0] * len(reads))]
    if len(weights) != len(reads):
        raise DagError(f"node {ctx.node.id!r}: {len(weights)} weights for {len(reads)} read columns")
    total = [sum(w * float(rows.columns[c][k]) for w, c in zip(weights, reads, strict=True)) for k in range(len(rows))]
    ctx.metrics[f"{ctx.node.writes[0]}_mean"] = sum(total) / max(len(total), 1)
    return {ctx.node.writes[0]: total}

"""Built-in ``compute`` node functions that need no model: combining columns, and the synthetic
generator and checksum the data-path benchmark and tests run (they move real bytes, but do no
model compute, so only the data path is measured).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sluice.api import Batch
from sluice.dag.functions import NodeContext
from sluice.dag.spec import DagError
from sluice.queue.packed import PackedColumn, offsets_of


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


VOCAB = 50_000
"""Token ids of ``synthetic_generate`` are ``(position + row) % VOCAB``."""


def synthetic_generate(ctx: NodeContext, rows: Batch) -> dict[str, Any]:
    """``options.group_size`` rows per prompt group, each ``options.tokens`` int32 token ids
    ``(position + row) % VOCAB`` in the first write column; any further write column gets a float
    per row (a stand-in reward). Each row is one copy out of a table cached in ``ctx.state``, so
    making rows costs about what writing their bytes does (the benchmark measures the data path)."""
    group_size = int(ctx.options.get("group_size", 1))
    tokens = int(ctx.options.get("tokens", 16))
    groups = [m.group_id for m in rows.meta]
    n = len(groups) * group_size
    row_ids = np.repeat(np.asarray(groups, dtype=np.int64) * group_size, group_size) + np.tile(
        np.arange(group_size), len(groups)
    )
    table = ctx.state.get("token_table")
    if table is None or len(table) != VOCAB + tokens:
        table = ctx.state["token_table"] = (np.arange(VOCAB + tokens, dtype=np.int64) % VOCAB).astype(np.int32)
    values = np.empty((n, tokens), dtype=np.int32)
    for k, start in enumerate((row_ids % VOCAB).tolist()):
        values[k] = table[start : start + tokens]
    column = PackedColumn(values.reshape(-1), offsets_of([tokens] * n), "list")
    out: dict[str, Any] = {ctx.node.writes[0]: column}
    for name in ctx.node.writes[1:]:
        out[name] = [float(r % 2) for r in row_ids.tolist()]
    return out


def token_checksum(ctx: NodeContext, rows: Batch) -> dict[str, list[int]]:
    """Sum of every token id of the first read column, per row: reads every byte it was sent."""
    column = rows.columns[ctx.node.reads[0]]
    if isinstance(column, PackedColumn) and len(column):
        sums = np.add.reduceat(column.values, column.offsets[:-1], dtype=np.int64).tolist()
        lengths = column.lengths().tolist()
        return {ctx.node.writes[0]: [s if n else 0 for s, n in zip(sums, lengths, strict=True)]}
    return {ctx.node.writes[0]: [int(sum(row)) for row in column]}

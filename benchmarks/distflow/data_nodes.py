"""The data-path benchmark's model-free DAG pieces: prompts that are their own indices, a
synthetic generator and a checksum (they move real bytes but do no model compute, so only the data
path is measured). ``benchmarks/dag.py`` and the DistFlow runtime's tests name the functions by
file path (``NODE = f"{__file__}:synthetic_generate"``: Ray workers, which lack ``benchmarks/`` on
their path, load the file); no ``sluice`` run uses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sluice.api import Batch
from sluice.dag.functions import NodeContext
from sluice.dag.loader import shard_range
from sluice.queue.packed import PackedColumn, offsets_of

SYNTHETIC_GENERATE = f"{Path(__file__).resolve()}:synthetic_generate"
TOKEN_CHECKSUM = f"{Path(__file__).resolve()}:token_checksum"


@dataclass(frozen=True)
class IndexPrompts:
    """``count`` prompts that are their own indices (the data-path benchmark and tests)."""

    count: int

    def __len__(self) -> int:
        return self.count

    def load(self, rank: int, size: int) -> list[int]:
        return list(shard_range(self.count, rank, size))


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

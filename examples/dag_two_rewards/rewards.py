"""The second reward of the two-reward DAG: a user's node function, found by its file path.

A node function gets the rows of one step (``rows.columns`` holds the columns the node reads)
and returns the columns it writes, one value per row.
"""

from sluice.api import Batch
from sluice.dag.functions import NodeContext


def length_penalty(ctx: NodeContext, rows: Batch) -> dict[str, list[float]]:
    """``-per_token`` for every response token beyond ``free_tokens`` (options of the node)."""
    free = int(ctx.options.get("free_tokens", 0))
    per_token = float(ctx.options.get("per_token", 0.01))
    lengths = [len(r) for r in rows.columns["response_ids"]]
    return {ctx.node.writes[0]: [-per_token * max(0, n - free) for n in lengths]}

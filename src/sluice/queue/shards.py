"""The data-parallel redistribution of the TransferQueue: equal-size shards of near-equal tokens.

Role: ``balance_shards`` splits a partition's rows over the ranks of a data-parallel stage (a
``Shard`` read, ``queue/controller.py``) and the ``token_balanced`` policy's candidate window into
micro-batches (``queue/policies.py``). A pure function of token counts, torch-free, so the
queue's controller actors never load torch.

Deliberately not here: cutting a trainer's micro-batches (``trainer/step.py`` cuts in arrival
order under a token budget) or choosing which rows are ready.
"""

from __future__ import annotations

from collections.abc import Sequence


def balance_shards(token_counts: Sequence[int], num_shards: int) -> list[list[int]]:
    """Split items into ``num_shards`` shards of equal size (±1 item) and near-equal token sums.

    Every rank of a stage gets the same number of rows (DistFlow's redistribution: 64 rows over
    4 ranks give 16 each) while the token load is balanced by LPT under that size limit (largest
    item first, to the least-loaded shard that still has room; ties on the lower shard).
    Deterministic in the token counts.

    Args:
        token_counts: ``[items]`` token count of each item (≥ 0).
        num_shards: number of shards (> 0); shards beyond the item count stay empty.

    Returns:
        ``num_shards`` lists of indices, ascending inside a shard; shard ``k`` holds
        ``ceil`` or ``floor`` of ``items / num_shards`` items, the larger ones first.
    """
    if num_shards <= 0:
        raise ValueError(f"num_shards must be > 0, got {num_shards}")
    if any(c < 0 for c in token_counts):
        raise ValueError("token counts must be non-negative")
    n = len(token_counts)
    room = [n // num_shards + (1 if k < n % num_shards else 0) for k in range(num_shards)]
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    loads = [0] * num_shards
    for i in sorted(range(n), key=lambda i: (-token_counts[i], i)):
        target = min((k for k in range(num_shards) if len(shards[k]) < room[k]), key=lambda k: (loads[k], k))
        shards[target].append(i)
        loads[target] += token_counts[i]
    return [sorted(s) for s in shards]

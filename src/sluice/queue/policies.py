"""Built-in batch selection policies of the TransferQueue: pure functions in a plain dict.

A policy is ``(candidates, batch_size) -> chosen row indices`` (``sluice.api.queue.Policy``): the
candidates are the rows that are ready for the task and not consumed by it; the controller checks
the choice and marks it consumed. Every built-in serves the oldest candidate first (lowest
``version``, then index), DESIGN.md's consumption rule, except ``fifo`` which is index order:

- ``fifo``: lowest index first.
- ``oldest_version``: lowest version first, ties by index.
- ``groups``: whole GRPO groups only (a group is complete when ``group_size`` of its rows are
  candidates), oldest first, while they fit in ``batch_size``.
- ``token_balanced``: ``batch_size`` rows of near-average token count. The oldest (up to)
  ``4 × batch_size`` candidates are split into micro-batches of ``batch_size`` rows and near-equal
  tokens by ``balance_shards`` (``queue/shards.py``, the one token balancer for data-parallel
  ranks), and the one holding the oldest candidate is served; so concurrent data-parallel
  consumers get micro-batches of near-equal token counts while the oldest row still goes first.

Splitting a whole partition into per-rank shards is the controller's job (``Shard``), not a
policy's: a policy sees only the rows still available, a shard must be the same for every rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from sluice.api.queue import Policy, RowMeta
from sluice.queue.shards import balance_shards


def fifo_policy(candidates: Sequence[RowMeta], batch_size: int) -> list[int]:
    """Lowest index first."""
    return heapq.nsmallest(batch_size, [m.index for m in candidates])


def oldest_version_policy(candidates: Sequence[RowMeta], batch_size: int) -> list[int]:
    """Lowest policy version first, ties by index (DESIGN.md: steps take the oldest rows first)."""
    return [i for _, i in heapq.nsmallest(batch_size, [(m.version, m.index) for m in candidates])]


def groups_policy(candidates: Sequence[RowMeta], batch_size: int) -> list[int]:
    """Whole groups only, oldest first; stops at the first complete group that does not fit.

    A group is complete once ``group_size`` of its rows are candidates; it contributes exactly
    ``group_size`` rows (its lowest indices; surplus rows wait for a later group). Raises
    ``ValueError`` if the oldest complete group alone exceeds ``batch_size`` (never servable).
    """
    groups: dict[int, list[RowMeta]] = {}
    for m in candidates:
        groups.setdefault(m.group_id, []).append(m)
    complete = [sorted(rows, key=lambda m: m.index)[: rows[0].group_size] for rows in groups.values()]
    complete = [rows for rows in complete if len(rows) == rows[0].group_size]
    complete.sort(key=lambda rows: (min(m.version for m in rows), rows[0].index))
    chosen: list[int] = []
    for rows in complete:
        if len(chosen) + len(rows) > batch_size:
            if not chosen and batch_size > 0:
                raise ValueError(f"group {rows[0].group_id} has {len(rows)} rows > batch_size {batch_size}")
            break
        chosen.extend(m.index for m in rows)
    return chosen


TOKEN_WINDOW = 4
"""``token_balanced`` balances over the oldest ``TOKEN_WINDOW × batch_size`` candidates."""


def token_balanced_policy(candidates: Sequence[RowMeta], batch_size: int) -> list[int]:
    """``batch_size`` rows of near-average token count, always including the oldest candidate.

    The oldest ``k × batch_size`` candidates (``k ≤ TOKEN_WINDOW``, by version then index) are
    split into ``k`` micro-batches of exactly ``batch_size`` rows and near-equal tokens by
    ``balance_shards`` (the queue's data-parallel split); the one holding the oldest row is served.
    """
    k = min(TOKEN_WINDOW, len(candidates) // max(1, batch_size))
    window = heapq.nsmallest(max(k, 1) * batch_size, candidates, key=lambda m: (m.version, m.index))
    if k <= 1:
        return [m.index for m in window]
    shards = balance_shards([m.num_tokens for m in window], k)
    oldest = next(s for s in shards if s and s[0] == 0)
    return [window[j].index for j in oldest]


POLICIES: dict[str, Policy] = {
    "fifo": fifo_policy,
    "oldest_version": oldest_version_policy,
    "groups": groups_policy,
    "token_balanced": token_balanced_policy,
}


def resolve_policy(policy: str | Policy) -> Policy:
    """A policy from its name in ``POLICIES`` or the function itself."""
    if callable(policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; built-ins: {sorted(POLICIES)}")
    return POLICIES[policy]

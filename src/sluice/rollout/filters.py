"""Dynamic group filters: decide, once a group is scored, whether it is trained or discarded.

A filter is a plain function ``(samples) -> reason | None``; a returned reason names the
discard in the run's counters, and the group's admission credit returns. Built-ins live in
``FILTERS`` (a plain dict). Filters do not touch the queue or the ledger.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sluice.api import Sample

GroupFilter = Callable[[Sequence[Sample]], str | None]


def zero_signal(samples: Sequence[Sample]) -> str | None:
    """Discard a group whose rewards are all equal: its GRPO advantages are all zero (DAPO)."""
    rewards = {s.reward for s in samples}
    return "zero_signal" if len(rewards) <= 1 else None


def reward_failure(samples: Sequence[Sample]) -> str | None:
    """Discard a group one of whose rewards failed (raised, timed out, not a finite number): the
    first failure's ``reward_<kind>:<name>`` reason. Applied before any configured filter."""
    return next((s.meta["reward_failure"] for s in samples if "reward_failure" in s.meta), None)


def reward_failure_cause(samples: Sequence[Sample]) -> tuple[str, str] | None:
    """The first failed reward call of a group: (``reward 'NAME'``, its error text); ``None``
    when every reward returned a number."""
    return next((s.meta["reward_failure_cause"] for s in samples if "reward_failure_cause" in s.meta), None)


FILTERS: dict[str, GroupFilter | None] = {"none": None, "zero_signal": zero_signal}

"""``AsyncCut``: the books of a run at a step boundary, as a checkpoint stores them.

Either admission strategy (``push.py``, ``multi.py``) takes one between steps and continues from
one on resume; ``resume.py`` writes it with the trainer's state. A plain record: it does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.api import GroupReport, PromptItem
from sluice.schedule.ledger import GroupLedger


@dataclass
class AsyncCut:
    """The controller's books at a step boundary."""

    next_group: int
    ledger: GroupLedger
    reports: dict[int, GroupReport]
    """Reports of groups written to the queue and not yet trained."""
    regenerate: list[tuple[PromptItem, int]]
    """Groups still generating: restarted on resume."""
    queue: dict[str, Any] = field(default_factory=dict)
    """The queue's state of the written, untrained groups' rows (``queue/snapshot.py``)."""
    steps: dict[int, int] = field(default_factory=dict)
    """``run.controller: multi``: the step (queue partition) of every untrained group, by id."""
    shards: list[dict[str, int]] = field(default_factory=list)
    """``run.controller: multi``: each rollout worker's prompt-shard cursor at the cut."""

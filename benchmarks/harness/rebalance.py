"""Dynamic rebalancing of rollout replicas while a run goes (StreamRL §4).

After each training step the caller reports the step's wall time (``step_s``), how long the
trainer computed (``train_s``) and how long generation kept the replicas busy (``generation_s``,
per replica). Decisions use the mean of the last ``window`` steps. With ``r`` replicas, one more
would cut generation to about ``generation_s · r / (r + 1)``, one fewer would raise it to
``generation_s · r / (r − 1)``:

- **add** a replica when the step waited for generation (``step_s > train_s · (1 + margin)``)
  and generation would still lag training even with one more
  (``generation_s · r / (r + 1) > train_s · (1 + margin)``): the lag exceeds what the new
  replica saves, so it pays;
- **remove** one when the step waited for training (``step_s <= train_s · (1 + margin)``) and
  training would still lag with one fewer (``generation_s · r / (r − 1) < train_s · (1 − margin)``):
  the replica's device is wasted;
- **stop adding** when an added replica did not shorten the step by at least ``margin / 2``
  (a long-tail response, not throughput, sets the step: more replicas cannot help); adding
  resumes once generation grows by more than ``margin`` again (lengths changed).

Replicas go in and out through ``LLMProxy.add_replica`` / ``remove_replica``, which load the
newest weights into a newcomer and move a leaving replica's requests elsewhere, so training
never stops. After an action the rebalancer waits ``cooldown`` steps for the measurement to
reflect it. ``decide`` is the pure rule; ``Rebalancer`` applies it.

It does not measure anything (the caller's step metrics do), nor pick the device a new replica
runs on (``new_replica`` does), nor move training devices.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sluice.rollout.proxy import LLMProxy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceConfig:
    min_replicas: int = 1
    max_replicas: int = 8
    margin: float = 0.1
    """Relative dead band around balance, so measurement noise does not flip replicas."""
    window: int = 2
    """Steps averaged per decision (an async step alternates long and short)."""
    cooldown: int = 2
    """Steps to let pass after an action before acting again (at least ``window``)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas or self.margin < 0 or self.window < 1:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, margin >= 0, window >= 1: {self}")
        if self.cooldown < self.window:
            raise ValueError(f"cooldown {self.cooldown} must be at least window {self.window}")


def decide(step_s: float, generation_s: float, train_s: float, replicas: int, config: RebalanceConfig) -> int:
    """+1 (add a replica), -1 (remove one) or 0 (see the module docstring)."""
    waited_for_generation = step_s > train_s * (1 + config.margin)
    with_one_more = generation_s * replicas / (replicas + 1)
    with_one_fewer = generation_s * replicas / max(replicas - 1, 1)
    if waited_for_generation and replicas < config.max_replicas and with_one_more > train_s * (1 + config.margin):
        return 1
    if not waited_for_generation and replicas > config.min_replicas and with_one_fewer < train_s * (1 - config.margin):
        return -1
    return 0


@dataclass(frozen=True)
class RebalanceEvent:
    step: int
    change: int
    """+1 added, -1 removed, 0 adding stopped (the last addition did not pay)."""
    replicas: int
    """Replicas after the change."""
    step_s: float
    generation_s: float
    train_s: float


class Rebalancer:
    """Applies ``decide`` to an ``LLMProxy`` after every step."""

    def __init__(self, proxy: LLMProxy, new_replica: Callable[[], Any], config: RebalanceConfig | None = None) -> None:
        self.proxy = proxy
        self.new_replica = new_replica
        self.config = config or RebalanceConfig()
        self.events: list[RebalanceEvent] = []
        self._history: list[tuple[float, float, float]] = []
        self._wait = 0
        self._added_from: tuple[float, float] | None = None  # (step_s, generation_s) before the last add
        self._ceiling: tuple[int, float] | None = None  # (replicas, generation_s) when adding stopped

    async def update(self, step: int, step_s: float, generation_s: float, train_s: float) -> int:
        """Report a finished step; add or remove a replica if the rule says so. Returns the change."""
        self._history.append((step_s, generation_s, train_s))
        if self._wait > 0:
            self._wait -= 1
            return 0
        recent = self._history[-self.config.window :]
        step_avg, gen_avg, train_avg = (sum(x) / len(recent) for x in zip(*recent, strict=True))
        replicas = len(self.proxy.replica_ids)
        self._judge_last_add(step, replicas, step_avg, gen_avg, train_avg)
        change = decide(step_avg, gen_avg, train_avg, replicas, self.config)
        if change > 0 and self._ceiling is not None and replicas >= self._ceiling[0]:
            change = 0
        if change > 0:
            self._added_from = (step_avg, gen_avg)
            await self.proxy.add_replica(self.new_replica())
        elif change < 0:
            await self.proxy.remove_replica(self.proxy.replica_ids[-1])
        if change:
            self._wait = self.config.cooldown
            self._record(step, change, step_avg, gen_avg, train_avg)
        return change

    def _judge_last_add(self, step: int, replicas: int, step_s: float, generation_s: float, train_s: float) -> None:
        if self._ceiling is not None and generation_s > self._ceiling[1] * (1 + self.config.margin):
            self._ceiling = None  # generation grew again: more replicas may pay now
        if self._added_from is None:
            return
        before_step, _ = self._added_from
        self._added_from = None
        if step_s > before_step * (1 - self.config.margin / 2):
            self._ceiling = (replicas, generation_s)
            self._record(step, 0, step_s, generation_s, train_s)

    def _record(self, step: int, change: int, step_s: float, generation_s: float, train_s: float) -> None:
        event = RebalanceEvent(step, change, len(self.proxy.replica_ids), step_s, generation_s, train_s)
        self.events.append(event)
        logger.info("rebalance: %s", event)

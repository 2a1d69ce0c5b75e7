"""Dynamic rebalancing of rollout replicas while a run goes (StreamRL §4): the rule and its memory.

After each training step the run reports the step's wall time (``step_s``), how long the
trainer computed (``train_s``) and how long generation kept the replicas busy (``generation_s``,
per replica). Decisions use the mean of the last ``window`` steps (none before ``window`` steps
ran). With ``r`` replicas, one more would cut generation to about ``generation_s · r / (r + 1)``,
one fewer would raise it to ``generation_s · r / (r − 1)``:

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

After an action the rebalancer waits ``cooldown`` steps for the measurement to reflect it.
``decide`` is the pure rule; ``Rebalancer`` keeps the window, the cooldown and the ceiling, and
returns the change for the caller to apply (``controller/rebalancing.py`` in a run, through the
rollout worker's ``LLMProxy.add_replica`` / ``remove_replica``; the simulator's harness on
simulated replicas). It measures nothing and moves no replica itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceRule:
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


def decide(step_s: float, generation_s: float, train_s: float, replicas: int, rule: RebalanceRule) -> int:
    """+1 (add a replica), -1 (remove one) or 0 (see the module docstring)."""
    waited_for_generation = step_s > train_s * (1 + rule.margin)
    with_one_more = generation_s * replicas / (replicas + 1)
    with_one_fewer = generation_s * replicas / max(replicas - 1, 1)
    if waited_for_generation and replicas < rule.max_replicas and with_one_more > train_s * (1 + rule.margin):
        return 1
    if not waited_for_generation and replicas > rule.min_replicas and with_one_fewer < train_s * (1 - rule.margin):
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
    reason: str


_REASONS = {
    1: "generation lags training: {g:.2f} s per replica vs {t:.2f} s training, step {s:.2f} s",
    -1: "the trainer waits for nothing: {g:.2f} s per replica vs {t:.2f} s training, step {s:.2f} s",
    0: "the last replica added did not shorten the step ({s:.2f} s): adding stops at this load",
}


@dataclass
class Rebalancer:
    """Applies ``decide`` over a window of steps with cooldown and a ceiling (module docstring)."""

    rule: RebalanceRule
    events: list[RebalanceEvent] = field(default_factory=list)
    _history: list[tuple[float, float, float]] = field(default_factory=list)
    _wait: int = 0
    _added_from: float | None = None  # the step time before the last add
    _ceiling: tuple[int, float] | None = None  # (replicas, generation_s) when adding stopped

    def observe(self, step: int, step_s: float, generation_s: float, train_s: float, replicas: int) -> int:
        """Report a finished step run by ``replicas`` replicas; returns the change to apply
        (+1, -1 or 0). Every change, and a stop of adding, is appended to ``events``."""
        self._history.append((step_s, generation_s, train_s))
        if len(self._history) < self.rule.window:  # one step alone is noise (the first: warm-up)
            return 0
        if self._wait > 0:
            self._wait -= 1
            return 0
        recent = self._history[-self.rule.window :]
        step_avg, gen_avg, train_avg = (sum(x) / len(recent) for x in zip(*recent, strict=True))
        self._judge_last_add(step, replicas, step_avg, gen_avg, train_avg)
        change = decide(step_avg, gen_avg, train_avg, replicas, self.rule)
        if change > 0 and self._ceiling is not None and replicas >= self._ceiling[0]:
            change = 0
        if change > 0:
            self._added_from = step_avg
        if change:
            self._wait = self.rule.cooldown
            self._record(step, change, replicas + change, step_avg, gen_avg, train_avg)
        return change

    def _judge_last_add(self, step: int, replicas: int, step_s: float, generation_s: float, train_s: float) -> None:
        if self._ceiling is not None and generation_s > self._ceiling[1] * (1 + self.rule.margin):
            self._ceiling = None  # generation grew again: more replicas may pay now
        if self._added_from is None:
            return
        before_step, self._added_from = self._added_from, None
        if step_s > before_step * (1 - self.rule.margin / 2):
            self._ceiling = (replicas, generation_s)
            self._record(step, 0, replicas, step_s, generation_s, train_s)

    def _record(self, step: int, change: int, replicas: int, step_s: float, gen_s: float, train_s: float) -> None:
        reason = _REASONS[change].format(g=gen_s, t=train_s, s=step_s)
        event = RebalanceEvent(step, change, replicas, step_s, gen_s, train_s, reason)
        self.events.append(event)
        logger.info("rebalance after step %d: %+d -> %d replicas (%s)", step, change, replicas, reason)

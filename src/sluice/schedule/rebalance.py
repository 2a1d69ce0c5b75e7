"""Dynamic rebalancing of rollout replicas while a run goes (StreamRL §4): the rule and its memory.

After each training step the run reports the step's wall time (``step_s``), how long the
trainer computed (``train_s``) and how long generation kept the replicas busy (``generation_s``,
per replica). Decisions use the mean of the last ``window`` steps; adding also asks the newest
step alone and takes the larger count (a step that grew is news). The thresholds are the
planner's: ``schedule/step_model.py`` predicts the step with more and with fewer replicas:

- **add** as many replicas as each cut the predicted step by ``MIN_SHARE`` (a quarter) of its
  ideal share ``1 / (r + 1)``, generation's whole span spread over them;
- **remove** one when the step predicted with one fewer is no longer than the measured one (the
  replicas' busy work, spread over one fewer, still fits beside training);
- **stop adding** when the added replicas did not cut the step by the threshold that justified
  them (``MIN_SHARE · k / r``); adding resumes once generation per replica grows by a share.

The asymmetry is the dead band against noise; why each threshold, and ``MIN_SHARE``'s history:
docs/planner.md ("Dynamic rebalancing"). After an action the rebalancer waits ``cooldown`` steps.
``decide`` is the pure rule; ``Rebalancer`` keeps the window, the cooldown and the ceiling, and
returns the change for the caller to apply (``controller/rebalancing.py`` in a run, through the
rollout worker's ``LLMProxy.add_replica`` / ``remove_replica``; the simulator's harness on
simulated replicas). It measures nothing and moves no replica itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sluice.schedule.step_model import generation_with, predicted_step_s

logger = logging.getLogger(__name__)

MIN_SHARE = 0.25
"""The least part of its ideal share (``1 / (r + 1)`` of the step) a replica must buy to be added
(and, measured after, to let adding go on)."""


@dataclass(frozen=True)
class RebalanceRule:
    min_replicas: int = 1
    max_replicas: int = 8
    window: int = 2
    """Steps averaged per decision (an async step alternates long and short)."""
    cooldown: int = 2
    """Steps to let pass after an action before acting again (at least ``window``)."""
    overlapped: bool = True
    """Generation overlaps training (``run.mode: async``); ``False``: a step generates, then trains."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas or self.window < 1:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, window >= 1: {self}")
        if self.cooldown < self.window:
            raise ValueError(f"cooldown {self.cooldown} must be at least window {self.window}")


def predicted(
    step_s: float, generation_s: float, train_s: float, replicas: int, new: int, rule: RebalanceRule
) -> float:
    """The planner's step model's step time with ``new`` replicas (``schedule/step_model.py``)."""
    return predicted_step_s(step_s, generation_s, train_s, replicas, new, overlapped=rule.overlapped)


def decide(step_s: float, generation_s: float, train_s: float, replicas: int, rule: RebalanceRule) -> int:
    """How many replicas to add (> 0) or remove (-1), or 0 (see the module docstring): adding
    goes on, replica by replica on the model's predictions, while each one more still buys its
    quarter share, so one decision reaches the count the model asks for; removing takes one."""
    target, now = replicas, step_s
    while target < rule.max_replicas:
        with_one_more = predicted(step_s, generation_s, train_s, replicas, target + 1, rule)
        if with_one_more >= now * (1 - MIN_SHARE / (target + 1)):
            break
        target, now = target + 1, with_one_more
    if target > replicas:
        return target - replicas
    if replicas <= rule.min_replicas:
        return 0
    with_one_fewer = predicted(step_s, generation_s, train_s, replicas, replicas - 1, rule)
    spread = generation_with(generation_s, replicas, replicas - 1)
    if with_one_fewer <= step_s and (not rule.overlapped or spread <= train_s * (1 - MIN_SHARE / replicas)):
        return -1
    return 0


@dataclass(frozen=True)
class RebalanceEvent:
    step: int
    change: int
    """> 0 added, -1 removed, 0 adding stopped (the last addition did not pay)."""
    replicas: int
    """Replicas after the change."""
    step_s: float
    generation_s: float
    train_s: float
    predicted_s: float
    """The step time the planner's model predicted with ``replicas`` (for a stop: what the
    addition promised)."""
    reason: str


_REASONS = {
    1: "generation lags training: {g:.2f} s per replica vs {t:.2f} s training, step {s:.2f} s, predicted {p:.2f} s "
    "with {k} more",
    -1: "the trainer waits for nothing: {g:.2f} s per replica vs {t:.2f} s training, step {s:.2f} s, predicted "
    "{p:.2f} s with one fewer",
    0: "the last replica added did not shorten the step as predicted ({s:.2f} s, predicted {p:.2f} s): adding "
    "stops at this load",
}


@dataclass
class Rebalancer:
    """Applies ``decide`` over a window of steps with cooldown and a ceiling (module docstring)."""

    rule: RebalanceRule
    events: list[RebalanceEvent] = field(default_factory=list)
    _history: list[tuple[float, float, float]] = field(default_factory=list)
    _wait: int = 0
    _added_from: tuple[float, float, int] | None = None  # the step before the last add, its prediction, replicas added
    _ceiling: tuple[int, float] | None = None  # (replicas, generation_s) when adding stopped

    def observe(self, step: int, step_s: float, generation_s: float, train_s: float, replicas: int) -> int:
        """Report a finished step run by ``replicas`` replicas; returns the change to apply
        (replicas to add, -1 or 0). Every change, and a stop of adding, is appended to ``events``."""
        self._history.append((step_s, generation_s, train_s))
        if len(self._history) < self.rule.window:  # one step alone is noise (the first: warm-up)
            return 0
        if self._wait > 0:
            self._wait -= 1
            return 0
        recent = self._history[-self.rule.window :]
        step_avg, gen_avg, train_avg = (sum(x) / len(recent) for x in zip(*recent, strict=True))
        window = (step_avg, gen_avg, train_avg)
        self._judge_last_add(step, replicas, *window)
        times, change = window, decide(*window, replicas, self.rule)
        if change >= 0 and (newest := decide(*recent[-1], replicas, self.rule)) > change:
            times, change = recent[-1], newest  # the newest step alone asks for more: news, not noise
        if change > 0 and self._ceiling is not None and replicas >= self._ceiling[0]:
            change = 0
        if change:
            after = predicted(*times, replicas, replicas + change, self.rule)
            self._added_from = (times[0], after, change) if change > 0 else None
            self._wait = self.rule.cooldown
            self._record(step, change, replicas + change, (*times, after))
        return change

    def _judge_last_add(self, step: int, replicas: int, step_s: float, generation_s: float, train_s: float) -> None:
        if self._ceiling is not None and generation_s > self._ceiling[1] * (1 + 1 / replicas):
            self._ceiling = None  # generation grew by more than a replica's share: more may pay now
        if self._added_from is None:
            return
        (before, promised, added), self._added_from = self._added_from, None
        if before - step_s < before * MIN_SHARE * added / replicas:  # the least cut that justified the adds
            self._ceiling = (replicas, generation_s)
            self._record(step, 0, replicas, (step_s, generation_s, train_s, promised))

    def _record(self, step: int, change: int, replicas: int, times: tuple[float, float, float, float]) -> None:
        """``times``: the window's step, generation and training seconds, and the predicted step."""
        step_s, gen_s, train_s, predicted_s = times
        reason = _REASONS[min(change, 1)].format(g=gen_s, t=train_s, s=step_s, p=predicted_s, k=change)
        event = RebalanceEvent(step, change, replicas, step_s, gen_s, train_s, predicted_s, reason)
        self.events.append(event)
        logger.info("rebalance after step %d: %+d -> %d replicas (%s)", step, change, replicas, reason)

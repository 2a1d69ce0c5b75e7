"""Options that compose with any base reward: routing by data source, a format gate, and DAPO's
soft overlong punishment.

- ``SourceRouter`` (``reward.by_source``): each row goes to the reward of its ``data_source``
  field (verl's ``default_compute_score`` pattern); a source without an entry goes to the
  fallback (``reward.fn`` / ``reward.name``), or raises naming the source, which the reward
  service counts as a failure of that call (the group is discarded, the run goes on).
- ``FormattedReward`` (``reward.format_pattern``): a response that does not match the pattern as
  a whole scores ``format_score`` and its base reward is not computed.
- ``overlong_penalty`` (``reward.overlong_buffer``): DAPO eq. 13, a function of the response's
  length in tokens, which only the rollout knows: the single-turn workflow adds it to the score
  (``OverlongPenalty``), so evaluation is never penalised.

Routers and gates are small frozen dataclasses of picklable parts, so the reward service ships
them to its processes like any reward. This module does not resolve names or paths (the
package's ``resolve_reward``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sluice.config import ConfigError
from sluice.rewards.imported import DEFAULT_SOURCE
from sluice.rewards.service import reward_name


@dataclass(frozen=True)
class SourceRouter:
    """``routes[fields["data_source"]]`` scores the row; a source without a route: ``fallback``."""

    routes: Mapping[str, Callable[..., Any]]
    fallback: Callable[..., Any] | None = None

    @property
    def __name__(self) -> str:
        """The name failures are counted under."""
        return "by_source"

    def __call__(self, response: str, **fields: Any) -> Any:
        source = fields.get("data_source", DEFAULT_SOURCE)
        fn = self.routes.get(source, self.fallback)
        if fn is None:
            raise LookupError(
                f"data_source {source!r} has no entry in reward.by_source ({', '.join(map(repr, self.routes))}) "
                "and neither reward.fn nor reward.name is set"
            )
        return fn(response, **fields)


@dataclass(frozen=True)
class FormattedReward:
    """``base`` for a response that fully matches ``pattern``, else ``score`` (``base`` not called)."""

    base: Callable[..., Any]
    pattern: str
    score: float

    @property
    def __name__(self) -> str:
        """The base reward's name: failures are its own."""
        return reward_name(self.base)

    def __call__(self, response: str, **fields: Any) -> Any:
        if re.fullmatch(self.pattern, response) is None:
            return self.score
        return self.base(response, **fields)


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment (eq. 13) of a ``length``-token response, ``L_max = max_len``,
    ``L_cache = buffer``: 0 up to ``L_max - L_cache``, then linear down to ``-factor`` at ``L_max``,
    ``-factor`` beyond. ``buffer = 0``: always 0."""
    if buffer <= 0:
        return 0.0
    expected = max_len - buffer
    if length <= expected:
        return 0.0
    if length <= max_len:
        return (expected - length) / buffer * factor
    return -factor


@dataclass(frozen=True)
class OverlongPenalty:
    """``penalty(length)``: ``overlong_penalty`` with a run's ``L_max``, ``L_cache`` and factor."""

    max_len: int
    buffer: int
    factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.buffer < self.max_len:
            raise ConfigError(
                f"reward.overlong_buffer: {self.buffer} must be between 1 and the response limit "
                f"rollout.max_new_tokens ({self.max_len}) minus 1"
            )

    def __call__(self, length: int) -> float:
        return overlong_penalty(length, self.max_len, self.buffer, self.factor)

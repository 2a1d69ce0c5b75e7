"""Skewness-aware dispatch on the live path (StreamRL §4, Alg. 2): which replica runs each request.

Decode time per iteration grows with the running batch past a knee (StreamRL Fig. 6), so a
long sample decoded in a big batch is slow exactly when everything else has finished. Given
predicted lengths (``length_ranker``), the algorithm puts the predicted long tail
(the top ``tail_share``) on ``k`` dedicated replicas that run small batches (at most
``tail_batch`` sequences: fast per token), the rest on the other replicas at full batch, in
longest-predicted-first order everywhere, and picks the ``k`` (including ``k = 0``: no
dedicated replicas) whose predicted makespan is smallest.

The planning half (``skewness_aware_dispatch``: how many replicas to dedicate and their batch cap,
from predictions and a cost model) is the benchmarks' (``benchmarks/harness/skew_plan.py``).
``LongTailSplit`` applies such a split on the live path: the
``LLMProxy`` (``fleet.long_tail_replicas``) asks it which requests are in the predicted long tail
(the top share of recent requests, as the ranker predicts them now), which replicas are dedicated
to them, and each replica's cap on running requests; its longest-first queue keeps one lane per
side. Nothing here touches an engine.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Sequence

from sluice.api import LengthPredictor
from sluice.config.fleet import FleetConfig


class LongTailSplit:
    """Skewness-aware dispatch on the live path: the ``LLMProxy`` side of StreamRL Alg. 2.

    ``replicas`` replicas are dedicated to the predicted long tail and run at most ``max_batch``
    requests each (small batches: fast per token past the knee); the other replicas take the rest
    at the proxy's full ``slots``. A request is in the long tail when the ranker predicts it longer
    than all but the top ``share`` of the last ``window`` requests' prompts, all predicted by the
    ranker as it is now: an online ranker's scale moves as it learns, so predictions made earlier
    are not comparable (a first wave predicted at the length cap would otherwise set the bar for
    good). When one side has no replica left (all removed), its requests go to the other side's
    replicas rather than wait for one that may never come.
    """

    def __init__(self, replicas: int, max_batch: int, *, share: float = 0.2, window: int = 1024) -> None:
        if replicas < 1 or max_batch < 1 or window < 1 or not 0.0 < share < 1.0:
            raise ValueError(
                f"need replicas >= 1, max_batch >= 1, window >= 1, 0 < share < 1 "
                f"(got {replicas}, {max_batch}, {window}, {share})"
            )
        self.replicas = replicas
        self.max_batch = max_batch
        self.share = share
        self.dedicated: set[int] = set()
        """Ids of the replicas that run the long tail now."""
        self._recent: deque[tuple[int, ...]] = deque(maxlen=window)
        self._threshold: float | None = None

    def record(self, prompt_ids: Sequence[int]) -> None:
        """Remember one arriving request's prompt (the long tail is a share of recent requests)."""
        self._recent.append(tuple(prompt_ids))
        self._threshold = None

    def is_tail(self, prompt_ids: Sequence[int], ranker: LengthPredictor) -> bool:
        """Whether ``ranker`` predicts ``prompt_ids`` longer than all but the top ``share`` of the
        recent requests (strictly: a ranker that predicts one constant puts nothing in the tail).
        The recent requests are re-predicted once after each new arrival, each distinct prompt once
        (a group's samples share theirs)."""
        if self._threshold is None:
            counts = Counter(self._recent)
            ranked = sorted(zip(ranker.predict(list(counts)), counts.values(), strict=True), reverse=True)
            above, self._threshold = int(self.share * len(self._recent)), math.inf
            for predicted, count in ranked:  # the (above + 1)-th longest request's prediction
                above -= count
                if above < 0:
                    self._threshold = predicted
                    break
        return ranker.predict([prompt_ids])[0] > self._threshold

    def join(self, replica_id: int) -> bool:
        """A replica starts taking requests: dedicate it while fewer than ``replicas`` are."""
        if len(self.dedicated) < self.replicas:
            self.dedicated.add(replica_id)
            return True
        return False

    def leave(self, replica_id: int) -> None:
        self.dedicated.discard(replica_id)

    def cap(self, replica_id: int, slots: int) -> int:
        """Running requests allowed on a replica whose regular cap is ``slots``."""
        return min(self.max_batch, slots) if replica_id in self.dedicated else slots

    def pool(self, replica_ids: Iterable[int], tail: bool) -> list[int]:
        """The replicas a request of the long tail (``tail``) or of the rest may run on: its own
        side's, or every replica while its side has none."""
        ids = list(replica_ids)
        return [r for r in ids if (r in self.dedicated) == tail] or ids


def long_tail_split(fleet: FleetConfig, max_batch: int) -> LongTailSplit | None:
    """The ``LLMProxy``'s ``LongTailSplit`` for a run's ``fleet`` options (``None``: off);
    ``max_batch`` is the regular replicas' cap (``rollout.max_batch``)."""
    if not fleet.long_tail_replicas:
        return None
    cap = min(fleet.long_tail_max_batch, max_batch)
    return LongTailSplit(fleet.long_tail_replicas, cap, share=fleet.long_tail_share)

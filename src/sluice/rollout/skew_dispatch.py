"""Skewness-aware dispatch (StreamRL §4, Alg. 2): which replica runs each request, at what batch size.

Decode time per iteration grows with the running batch past a knee (StreamRL Fig. 6), so a
long sample decoded in a big batch is slow exactly when everything else has finished. Given
predicted lengths (``length_ranker``), ``skewness_aware_dispatch`` puts the predicted long tail
(the top ``tail_share``) on ``k`` dedicated replicas that run small batches (at most
``tail_batch`` sequences: fast per token), the rest on the other replicas at full batch, in
longest-predicted-first order everywhere, and picks the ``k`` (including ``k = 0``: no
dedicated replicas) whose predicted makespan is smallest.

``skewness_aware_dispatch`` is a pure function of predictions and a cost model, for planning
(choosing how many replicas to dedicate and their batch cap: ``benchmarks/rollout.py``,
``benchmarks/length_ranker.py``). ``LongTailSplit`` applies such a split on the live path: the
``LLMProxy`` (``fleet.long_tail_replicas``) asks it which requests are in the predicted long tail
(the top share of recent requests, as the ranker predicts them now), which replicas are dedicated
to them, and each replica's cap on running requests; its longest-first queue keeps one lane per
side. Nothing here touches an engine.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from sluice.api import LengthPredictor
from sluice.config.fleet import FleetConfig
from sluice.rollout.length_ranker import long_tail, lpt_order

StepTime = Callable[[int], float]
"""Seconds of one decode iteration with ``running`` sequences in the batch (StreamRL's T_ptl)."""


def knee_step_time(decode_s: float, knee: int) -> StepTime:
    """``decode_s · max(1, running / knee)``: flat while memory-bound, then linear (as ``SimEngine``)."""
    return lambda running: decode_s * max(1.0, running / knee)


@dataclass(frozen=True)
class DispatchPlan:
    replica_of: tuple[int, ...]
    """For each request (input order), the replica that runs it."""
    order: tuple[tuple[int, ...], ...]
    """For each replica, its requests' indices in submission order (longest predicted first)."""
    max_batch: tuple[int, ...]
    """For each replica, the cap on sequences decoding together."""
    tail_replicas: tuple[int, ...]
    """Replicas dedicated to the predicted long tail (empty when no split beat plain LPT)."""
    predicted_makespan: float
    """Seconds until the last request finishes, under the cost model and the predictions."""


def replica_makespan(lengths: Sequence[float], max_batch: int, step_time: StepTime) -> float:
    """Time for one continuously batched replica to decode ``lengths`` (tokens, admitted in this
    order, at most ``max_batch`` at a time, a finished one's slot refilled at once)."""
    pending = deque(max(1, math.ceil(n)) for n in lengths)
    finishing: list[int] = []  # decode iterations after which each running sequence is done
    iteration, seconds = 0, 0.0
    while pending or finishing:
        while pending and len(finishing) < max_batch:
            heapq.heappush(finishing, iteration + pending.popleft())
        next_done = finishing[0]
        seconds += (next_done - iteration) * step_time(len(finishing))
        iteration = next_done
        while finishing and finishing[0] == iteration:
            heapq.heappop(finishing)
    return seconds


def knee_batch(step_time: StepTime, max_batch: int) -> int:
    """The largest batch whose iteration costs no more than a single sequence's (the knee)."""
    floor = step_time(1)
    return max((b for b in range(1, max_batch + 1) if step_time(b) <= floor * (1 + 1e-9)), default=1)


def skewness_aware_dispatch(
    predicted: Sequence[float],
    num_replicas: int,
    step_time: StepTime,
    *,
    max_batch: int,
    tail_share: float = 0.2,
    tail_batch: int | None = None,
) -> DispatchPlan:
    """Assign requests with ``predicted`` lengths to ``num_replicas`` replicas (module docstring).

    ``max_batch`` caps the regular replicas; ``tail_batch`` the long-tail ones (default: the best
    of the knee of ``step_time`` and its doublings up to ``max_batch``); ``tail_share`` is the
    predicted share treated as long tail.
    """
    if num_replicas < 1 or max_batch < 1:
        raise ValueError(f"need num_replicas >= 1 and max_batch >= 1, got {num_replicas}, {max_batch}")
    if tail_batch is not None:
        tail_caps = [min(tail_batch, max_batch)]
    else:
        knee = knee_batch(step_time, max_batch)
        tail_caps = sorted({min(knee << j, max_batch) for j in range(max_batch.bit_length())})
    everything = lpt_order(predicted)
    tail = long_tail(predicted, tail_share) if predicted else []
    tail_set = set(tail)
    regular = [i for i in everything if i not in tail_set]
    best = _plan(predicted, [(everything, num_replicas, max_batch)], step_time)
    for k in range(1, num_replicas):
        for cap in tail_caps:
            candidate = _plan(predicted, [(tail, k, cap), (regular, num_replicas - k, max_batch)], step_time)
            if candidate.predicted_makespan < best.predicted_makespan:
                best = candidate
    return best


def _plan(predicted: Sequence[float], pools: list[tuple[list[int], int, int]], step_time: StepTime) -> DispatchPlan:
    """Pools of (requests in LPT order, replicas, batch cap), numbered in order; the first of two
    pools is the long tail. Within a pool, each request goes to the replica with the least
    predicted work so far (Graham's LPT list scheduling)."""
    replica_of = [0] * len(predicted)
    order: list[tuple[int, ...]] = []
    caps: list[int] = []
    makespan = 0.0
    for requests, replicas, cap in pools:
        queues: list[list[int]] = [[] for _ in range(replicas)]
        load = [(0.0, r) for r in range(replicas)]
        for i in requests:
            work, r = heapq.heappop(load)
            queues[r].append(i)
            heapq.heappush(load, (work + predicted[i], r))
        for queue in queues:
            for i in queue:
                replica_of[i] = len(order)
            makespan = max(makespan, replica_makespan([predicted[i] for i in queue], cap, step_time))
            order.append(tuple(queue))
            caps.append(cap)
    tail_replicas = tuple(range(pools[0][1])) if len(pools) == 2 else ()
    return DispatchPlan(tuple(replica_of), tuple(order), tuple(caps), tail_replicas, makespan)


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

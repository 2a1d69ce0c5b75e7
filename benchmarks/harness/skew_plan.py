"""Skewness-aware dispatch planning (StreamRL §4, Alg. 2), for the benchmarks: given predicted
lengths and a decode cost model, which replica runs each request at what batch cap, and how many
replicas to dedicate to the predicted long tail (``k = 0`` included), by predicted makespan.

``benchmarks/length_ranker.py`` plans with it; a run applies such a split on the live path with
``sluice.rollout.skew_dispatch.LongTailSplit`` (``fleet.long_tail_replicas``).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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

"""The planner's step-time model: a step's time from its generation work, its training and the
long tail, and how it moves when the rollout gains or loses a replica.

One model for two users: ``sluice plan``'s analytic bound (``sim/planner.py: lower_bound_s``,
from the cost model's predicted work) and a run's rebalancing rule (``schedule/rebalance.py``,
from the step's measured times). A step that overlaps generation with training (``run.mode:
async``; the simulator's ``streaming``, ``one_step`` and ``async``) takes the longest of the
three; a synchronous one generates, then trains. Generation work spreads evenly over the
replicas; training and the tail (one response's sequential decode) do not.

It measures nothing and decides nothing: the callers bring the times and judge the prediction.
"""

from __future__ import annotations


def step_time_s(generation_s: float, train_s: float, tail_s: float = 0.0, *, overlapped: bool) -> float:
    """A step's time: ``generation_s`` of generation work per replica, ``train_s`` of training
    and a tail of ``tail_s`` (the longest response decoded alone)."""
    if overlapped:
        return max(generation_s, train_s, tail_s)
    return max(generation_s, tail_s) + train_s


def generation_with(generation_s: float, replicas: int, new_replicas: int) -> float:
    """Generation work per replica when the same work spreads over ``new_replicas``."""
    return generation_s * replicas / new_replicas


def generation_span_s(step_s: float, generation_s: float, train_s: float, *, overlapped: bool) -> float:
    """How long generation took to deliver a measured step's batch: overlapped, the whole step
    when it outlasted training (the trainer waited: generation set it), else the replicas' busy
    time; in sequence, the part of the step that was not training (at least the busy time)."""
    if overlapped:
        return max(generation_s, step_s) if step_s > train_s else generation_s
    return max(generation_s, step_s - train_s)


def predicted_step_s(
    step_s: float, generation_s: float, train_s: float, replicas: int, new_replicas: int, *, overlapped: bool
) -> float:
    """The step time the model predicts with ``new_replicas`` replicas, from a step of ``step_s``
    measured with ``replicas`` whose replicas were busy ``generation_s`` each and whose trainer
    computed ``train_s``. More replicas: generation's span (``generation_span_s``, a tail
    included) spreads over them, never lengthening the step. Fewer: the replicas' busy work
    spreads over fewer and the part of the step the model does not explain (a tail, a reward's
    wait) stays."""
    if new_replicas > replicas:
        span = generation_with(
            generation_span_s(step_s, generation_s, train_s, overlapped=overlapped), replicas, new_replicas
        )
        return min(step_time_s(span, train_s, overlapped=overlapped), step_s)
    now = step_time_s(generation_s, train_s, overlapped=overlapped)
    then = step_time_s(generation_with(generation_s, replicas, new_replicas), train_s, overlapped=overlapped)
    return max(step_s + then - now, train_s)

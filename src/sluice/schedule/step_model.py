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


def predicted_step_s(
    step_s: float, generation_s: float, train_s: float, replicas: int, new_replicas: int, *, overlapped: bool
) -> float:
    """The step time the model predicts with ``new_replicas`` replicas, from a step measured with
    ``replicas``: the measured step moved by the model's difference between the two counts (the
    part of the step the model does not explain, a tail or a reward wait, stays), never below
    the training time."""
    now = step_time_s(generation_s, train_s, overlapped=overlapped)
    then = step_time_s(generation_with(generation_s, replicas, new_replicas), train_s, overlapped=overlapped)
    return max(step_s + then - now, train_s)

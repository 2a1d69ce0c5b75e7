"""PPO mini-batches and epochs inside one training step, over a proximal policy fixed at its start.

A training step consumes one global batch and advances the policy version once (DESIGN.md), but
may take several optimizer updates: the batch is cut into ``mini_batches`` contiguous parts of
nearly equal size (in arrival order), each one optimizer update with its own normaliser, and the
whole pass is repeated ``epochs`` times. A step that must be held (several updates, whole-batch
advantages, a critic) has all its samples here, so each update's are packed into the fewest
micro-batches under the token budget (``trainer/step.py``: ``pack_balanced``); a step that could
stream keeps the arrival-order cuts (``streamable``). The proximal log-probs are those of the
policy at the start of the step, recomputed once when the step's global batch has arrived
(decoupled PPO, AReaL eq. 5), so from the second update on the current policy genuinely moves
away from them and the clip acts as a trust region around the step's start. With ``recompute_prox`` off the
proximal policy is the behaviour policy (standard PPO).

The default schedule (one mini-batch, one epoch) is a single update that a streaming trainer
can accumulate while groups still arrive (``UpdateSchedule.streams``); more updates need the
whole batch first. Deliberately not here: choosing micro-batch cuts (``trainer/step.py``) and
running models (the engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.api import Algorithm, Sample, TrainEngine
from sluice.trainer.step import InOrderPacker, pack_balanced, run_step

MEAN_METRICS = frozenset({"loss", "grad_norm", "lr", "logprob_gap_mean", "logprob_gap_max"})
"""Per-update metrics averaged over a step's updates; every other metric is a sum."""


@dataclass(frozen=True)
class UpdateSchedule:
    """How one training step turns its global batch into optimizer updates."""

    mini_batches: int = 1
    epochs: int = 1
    recompute_prox: bool = False
    """Proximal log-probs from the policy at the step's start (decoupled PPO) instead of the
    behaviour log-probs (standard PPO)."""

    def __post_init__(self) -> None:
        if self.mini_batches < 1 or self.epochs < 1:
            raise ValueError(f"mini_batches and epochs must be >= 1, got {self.mini_batches}, {self.epochs}")

    @property
    def updates(self) -> int:
        return self.mini_batches * self.epochs

    @property
    def streams(self) -> bool:
        """One update per step: micro-batches can be accumulated as the batch arrives."""
        return self.updates == 1


ONE_UPDATE = UpdateSchedule()
"""The default: one streaming update per step, proximal = behaviour policy."""


def streamable(schedule: UpdateSchedule, algorithm: Algorithm, critic: bool) -> bool:
    """Whether a step could be trained as its groups arrive: one update, advantages per group, no
    critic. Such a step is cut in arrival order even when held (its cuts then equal the streamed
    step's, bit for bit); every other step is held and packed into the fewest micro-batches."""
    return schedule.streams and not algorithm.whole_batch_advantages and not critic


def mini_batch_ranges(num_samples: int, mini_batches: int) -> list[range]:
    """Contiguous index ranges of nearly equal size (the first ones one larger), in order; never
    empty (fewer ranges when there are fewer samples than ``mini_batches``)."""
    parts = min(mini_batches, num_samples)
    base, extra = divmod(num_samples, parts) if parts else (0, 0)
    out, start = [], 0
    for k in range(parts):
        size = base + (1 if k < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def proximal_logprobs(
    engine: TrainEngine, samples: Sequence[Sample], schedule: UpdateSchedule, temperature: float
) -> list[list[float]]:
    """``[samples][response tokens]``: the current policy's log-probs (decoupled PPO), or the
    behaviour log-probs when the schedule does not recompute them. The engine is asked even for
    no samples: a sharded engine's forwards are collectives its other ranks wait in."""
    if schedule.recompute_prox:
        return engine.logprobs(samples, temperature)
    return [list(s.behav_logprobs) for s in samples]


@dataclass(frozen=True)
class MiniBatchPart:
    """One mini-batch of a step as one trainer (rank) sees it."""

    mine: tuple[int, ...]
    """Indices, into this rank's own samples, of those the mini-batch holds (maybe none)."""
    normaliser: float
    """The whole mini-batch's normaliser, over every rank's samples."""


def mini_batch_plan(
    step_samples: Sequence[Sample], algorithm: Algorithm, mini_batches: int, mine: Sequence[int] | None = None
) -> list[MiniBatchPart]:
    """The step's mini-batches, cut over ``step_samples`` (the whole step, every rank's samples,
    in arrival order); ``mine`` are the ascending positions in it of this rank's own samples
    (``None``: one trainer owns them all). Every rank gets the same cuts and normalisers, so
    summing the ranks' gradients of each mini-batch gives the one-trainer update."""
    owned = range(len(step_samples)) if mine is None else mine
    plan = []
    for part in mini_batch_ranges(len(step_samples), mini_batches):
        local = tuple(k for k, position in enumerate(owned) if position in part)
        plan.append(MiniBatchPart(local, algorithm.normaliser([step_samples[i] for i in part])))
    return plan


def run_updates(
    engine: TrainEngine,
    samples: Sequence[Sample],
    advantages: Sequence[Sequence[float]],
    prox_logprobs: Sequence[Sequence[float]],
    algorithm: Algorithm,
    micro_batch_tokens: int,
    schedule: UpdateSchedule,
    plan: Sequence[MiniBatchPart] | None = None,
    balanced: bool = False,
) -> list[dict[str, float]]:
    """Every optimizer update of one step, epoch by epoch, mini-batch by mini-batch; returns each
    update's metrics. ``prox_logprobs`` stay fixed for the whole step. ``plan`` (data
    parallelism: ``mini_batch_plan`` over every rank's samples) says which of ``samples`` each
    mini-batch holds and its normaliser; by default ``samples`` are the whole step. ``balanced``:
    each update's samples in the fewest micro-batches (``pack_balanced``), else cut in order."""
    if plan is None:
        plan = mini_batch_plan(samples, algorithm, schedule.mini_batches)
    results = []
    for _ in range(schedule.epochs):
        for part in plan:
            sub = [samples[i] for i in part.mine]
            advantages_, prox_ = [advantages[i] for i in part.mine], [prox_logprobs[i] for i in part.mine]
            if balanced:
                planned = pack_balanced(sub, advantages_, prox_, micro_batch_tokens)
            else:
                packer = InOrderPacker(micro_batch_tokens)
                planned = packer.add(sub, advantages_, prox_) + packer.flush()
            results.append(run_step(engine, planned, algorithm, part.normaliser))
    return results


def merge_update_metrics(updates: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its updates: ``loss`` and ``grad_norm`` averaged, the rest
    (token counts, stat sums, skipped steps) summed; ``optimizer_steps`` counts the updates.
    A single update's metrics come back unchanged apart from ``optimizer_steps``."""
    merged: dict[str, float] = {}
    for metrics in updates:
        for key, value in metrics.items():
            merged[key] = merged.get(key, 0.0) + value
    for key in MEAN_METRICS & merged.keys():
        merged[key] = merged[key] / len(updates) if len(updates) > 1 else updates[0][key]
    merged["optimizer_steps"] = float(len(updates))
    return merged

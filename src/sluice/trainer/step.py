"""Plan and run one training step: advantages, in-order token-budgeted micro-batches, and one
optimizer step over their summed gradients scaled by the step-wide normaliser.

A streaming step's micro-batches are cut in the samples' arrival order (``InOrderPacker``: a
micro-batch closes when the next sample would overflow the token budget, so every cut depends
only on samples already seen); a held step, whose samples are all here, is packed into the
fewest micro-batches under the budget (``pack_balanced``). Micro-batches are summed with
normaliser 1; the gradient is scaled by ``1 / normaliser`` (the
step's loss tokens, or sequences for the seq-mean aggregation modes) at the end, once the
step's size is known. A streaming trainer fed the same
samples in the same order performs exactly the same floating-point operations as a
whole-batch step, so streaming at η = 0 reproduces the sync loop bit for bit. This module does
not run models itself; it drives a ``TrainEngine`` (``sluice.api``).
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.api import Algorithm, MicroBatch, Sample, TrainEngine


def step_normaliser(samples: Sequence[Sample], algorithm: Algorithm | None = None) -> float:
    """The step-wide loss denominator: ``algorithm.normaliser`` (its aggregation mode decides),
    or token-mean over the global batch (loss tokens, at least 1) without an algorithm."""
    if algorithm is not None:
        return algorithm.normaliser(samples)
    return float(max(sum(sum(s.loss_mask) for s in samples), 1))


class InOrderPacker:
    """Cuts arriving samples into micro-batches of at most ``budget`` tokens (normaliser 1)."""

    def __init__(self, budget: int) -> None:
        if budget <= 0:
            raise ValueError(f"micro-batch token budget must be > 0, got {budget}")
        self.budget = budget
        self.samples: list[Sample] = []
        self._open: list[tuple[Sample, Sequence[float], Sequence[float]]] = []
        self._tokens = 0

    def add(
        self,
        samples: Sequence[Sample],
        advantages: Sequence[Sequence[float]],
        prox_logprobs: Sequence[Sequence[float]] | None = None,
    ) -> list[MicroBatch]:
        """Add samples in order; returns the micro-batches they completed."""
        prox = prox_logprobs if prox_logprobs is not None else [s.behav_logprobs for s in samples]
        done = []
        for s, adv, p in zip(samples, advantages, prox, strict=True):
            if self._open and self._tokens + s.num_tokens > self.budget:
                done.append(self._close())
            self._open.append((s, adv, p))
            self._tokens += s.num_tokens
            self.samples.append(s)
        return done

    def flush(self) -> list[MicroBatch]:
        """The last, partial micro-batch (if any)."""
        return [self._close()] if self._open else []

    def _close(self) -> MicroBatch:
        mb = MicroBatch(
            samples=tuple(s for s, _, _ in self._open),
            advantages=tuple(tuple(a) for _, a, _ in self._open),
            prox_logprobs=tuple(tuple(p) for _, _, p in self._open),
            normaliser=1.0,
        )
        self._open, self._tokens = [], 0
        return mb


def pack_balanced(
    samples: Sequence[Sample],
    advantages: Sequence[Sequence[float]],
    prox_logprobs: Sequence[Sequence[float]],
    budget: int,
) -> list[MicroBatch]:
    """A held step's micro-batches: the fewest passes under ``budget`` tokens (AReaL's dynamic
    allocation, first-fit decreasing: the longest sample first, each into the first micro-batch
    it fits), each micro-batch's samples in their given order; a sample over the budget gets a
    micro-batch of its own. Only for samples that are all here: a streaming step cuts in arrival
    order (``InOrderPacker``), so its cuts never wait for samples still to come."""
    if budget <= 0:
        raise ValueError(f"micro-batch token budget must be > 0, got {budget}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(samples)), key=lambda k: (-samples[k].num_tokens, k)):
        size = samples[i].num_tokens
        slot = next((b for b, load in enumerate(loads) if load + size <= budget), None)
        if slot is None:
            bins.append([i])
            loads.append(size)
        else:
            bins[slot].append(i)
            loads[slot] += size
    return [
        MicroBatch(
            samples=tuple(samples[i] for i in sorted(members)),
            advantages=tuple(tuple(advantages[i]) for i in sorted(members)),
            prox_logprobs=tuple(tuple(prox_logprobs[i]) for i in sorted(members)),
            normaliser=1.0,
        )
        for members in bins
    ]


def plan_step(
    samples: Sequence[Sample],
    algorithm: Algorithm,
    micro_batch_tokens: int,
    prox_logprobs: Sequence[Sequence[float]] | None = None,
) -> list[MicroBatch]:
    """A whole step's micro-batches, exactly as ``InOrderPacker`` forms them while streaming.

    ``prox_logprobs`` defaults to the behaviour log-probs (standard PPO, exact on-policy).
    """
    packer = InOrderPacker(micro_batch_tokens)
    planned = packer.add(samples, algorithm.advantages(samples), prox_logprobs)
    return planned + packer.flush()


def run_step(
    engine: TrainEngine, micro_batches: Sequence[MicroBatch], algorithm: Algorithm, normaliser: float
) -> dict[str, float]:
    """One optimizer step: accumulate every micro-batch, then scale by ``1 / normaliser``."""
    engine.begin_step()
    for mb in micro_batches:
        engine.accumulate(mb, algorithm)
    return engine.finish_step(grad_scale=1.0 / normaliser)

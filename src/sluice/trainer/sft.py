"""The supervised step: token-mean cross-entropy on the trained tokens, on the RL trainer's engine.

An SFT row becomes a ``Sample`` whose prompt is its tokens before the first trained one and whose
response is the rest, with ``loss_mask`` marking the trained tokens (every assistant turn of a
multi-turn conversation; ``data/conversations.py``). So the step is the RL step's machinery:
``plan_step`` cuts the rows into micro-batches of ``trainer.micro_batch_tokens`` in order,
``HFTrainEngine`` packs each into padding-free rows (``engines/packing.py``; every row its own
family), accumulates the gradients and takes one clipped AdamW step under its strategy, dtype,
LoRA and LR schedule. ``SftLoss`` is the ``Algorithm`` whose loss is the negative log-likelihood
summed over trained tokens, normalised by the step's trained tokens. The order of rows over epochs
(``batch_rows``) is a pure function of the step, so a resumed run continues the same order.

Deliberately not here: reading or rendering rows (``data/``), which rank trains which rows,
evaluation, checkpoints and logs (``controller/sft.py``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from functools import lru_cache

from sluice.api import MicroBatch, Sample, TrainEngine
from sluice.api.types import LossInputs, LossOutputs
from sluice.trainer.step import plan_step, run_step


class SftLoss:
    """``Algorithm`` of supervised fine-tuning: no advantages, ``-Σ log p`` over trained tokens."""

    whole_batch_advantages = False
    uses_entropy = False
    uses_reference = False

    def advantages(self, samples: Sequence[Sample]) -> list[list[float]]:
        return [[0.0] * len(s.response_ids) for s in samples]

    def loss(self, inputs: LossInputs) -> LossOutputs:
        """Summed NLL of the micro-batch's trained tokens ``[tokens]`` over the step's normaliser."""
        nll = -(inputs.logp * inputs.mask).sum()
        return LossOutputs(nll / inputs.normaliser, {"trained_tokens": float(inputs.mask.sum())})

    def normaliser(self, samples: Sequence[Sample]) -> float:
        """The step's trained tokens (at least 1): the loss is their mean."""
        return float(max(sum(sum(s.loss_mask) for s in samples), 1))


SFT_LOSS = SftLoss()


def as_sample(ids: Sequence[int], train: Sequence[int], index: int) -> Sample:
    """Row ``index``'s tokens as a ``Sample``: the prompt up to its first trained token."""
    first = next((i for i, t in enumerate(train) if t), None)
    if first is None or first == 0:
        raise ValueError(f"row {index}: needs a trained token after the first token")
    response = tuple(ids[first:])
    zeros = tuple(0.0 for _ in response)
    return Sample(
        uid=f"sft-{index}",
        group_id=index,
        prompt_ids=tuple(ids[:first]),
        response_ids=response,
        behav_logprobs=zeros,
        token_versions=tuple(0 for _ in response),
        loss_mask=tuple(int(t) for t in train[first:]),
        reward=0.0,
    )


def sft_micro_batches(samples: Sequence[Sample], micro_batch_tokens: int) -> list[MicroBatch]:
    """The step's micro-batches, in order, each at most ``micro_batch_tokens`` tokens."""
    return plan_step(samples, SFT_LOSS, micro_batch_tokens)


def sft_step(
    engine: TrainEngine, samples: Sequence[Sample], micro_batch_tokens: int, normaliser: float | None = None
) -> dict[str, float]:
    """One optimizer step on ``samples``; the engine's totals (``loss``: the token-mean NLL).
    ``normaliser``: the whole step's trained tokens when ``samples`` is one rank's share of it."""
    scale = normaliser if normaliser is not None else SFT_LOSS.normaliser(samples)
    return run_step(engine, sft_micro_batches(samples, micro_batch_tokens), SFT_LOSS, scale)


def nll_sums(engine: TrainEngine, samples: Sequence[Sample]) -> tuple[float, float]:
    """(summed NLL, count) of the trained tokens of ``samples`` under the current weights (no grad)."""
    logprobs = engine.logprobs(samples, 1.0)
    total = sum(
        -lp for s, row in zip(samples, logprobs, strict=True) for lp, m in zip(row, s.loss_mask, strict=True) if m
    )
    return total, float(sum(sum(s.loss_mask) for s in samples))


def total_steps(rows: int, batch_size: int, epochs: float, steps: int | None) -> int:
    """Optimizer steps of a run: ``steps``, or ``ceil(epochs × rows ÷ batch_size)``."""
    return steps if steps is not None else max(1, math.ceil(epochs * rows / batch_size))


def batch_rows(rows: int, batch_size: int, step: int, seed: int, limit: int | None = None) -> list[int]:
    """Row indices of 0-based ``step``: positions ``step·B …`` of the endless stream of epochs,
    each epoch a permutation seeded by ``(seed, epoch)``; positions from ``limit`` on are cut
    (a fractional last epoch)."""
    stop = (step + 1) * batch_size if limit is None else min((step + 1) * batch_size, limit)
    return [_order(rows, seed, p // rows)[p % rows] for p in range(step * batch_size, stop)]


@lru_cache(maxsize=4)
def _order(rows: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(rows))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)

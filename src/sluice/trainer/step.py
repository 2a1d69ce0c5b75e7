"""Plan one training step: advantages, the step-wide normaliser, token-budgeted micro-batches.

The plan is pure data (``MicroBatch`` values); the train engine executes it. Because every
micro-batch carries the same step-wide normaliser, the accumulated gradient equals the
full-batch gradient however the batch is split. This module does not run models.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.api import Algorithm, MicroBatch, Sample
from sluice.trainer.microbatch import make_micro_batches


def plan_step(
    samples: Sequence[Sample],
    algorithm: Algorithm,
    micro_batch_tokens: int,
    prox_logprobs: Sequence[Sequence[float]] | None = None,
) -> list[MicroBatch]:
    """Split a global batch into micro-batches of at most ``micro_batch_tokens`` tokens.

    ``prox_logprobs`` defaults to the behaviour log-probs (standard PPO: prox = behav), which is
    exact for on-policy steps.
    """
    if not samples:
        return []
    advantages = algorithm.advantages(samples)
    prox = prox_logprobs if prox_logprobs is not None else [s.behav_logprobs for s in samples]
    return make_micro_batches(samples, advantages, prox, micro_batch_tokens)

"""PPO with a learned critic: one training step of GAE advantages, actor updates and critic updates.

Per sample, the per-token rewards are 0 except the sequence reward on its last loss token, minus
``kl_coef · kl_t`` on every loss token when the algorithm puts the KL in the reward (behaviour
vs reference log-probs, so the penalty is shaped per token). The critic's values of the same
tokens (taken once, before any update of the step) give GAE advantages and returns
(``trainer/algos/gae.py``); the advantages are whitened over the step's loss tokens. The actor
then takes the step's updates (``trainer/updates.py``: mini-batches, epochs, proximal policy),
and the critic the same schedule of clipped value-regression updates towards the returns,
clipped around the values the advantages came from. The policy version advances once.

The step itself is ``trainer/rl_step.py``'s ``train_global_batch`` with a critic: it takes the
values from the critic or as given, which is how the asynchronous pipeline's trainer runs it:
there the values are a queue column written by the critic-values task
(``dag/node_worker.py``) with the newest critic the trainer has published.

Deliberately not here: the models (``engines/critic.py``, ``engines/hf_train.py``) and serving
the values task.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.api import Sample
from sluice.engines.critic import CriticEngine
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.algos.gae import gae
from sluice.trainer.losses.regularizers import kl_estimate
from sluice.trainer.updates import (
    UpdateSchedule,
    mini_batch_ranges,
)

VALUES_COLUMN = "values"
"""Per-response-token values of the critic, the column the critic-values task writes."""


@dataclass(frozen=True)
class CriticSpec:
    """How to build and train PPO's critic (picklable: Ray workers receive it)."""

    lr: float
    value_clip: float = 0.2
    grad_clip: float = 1.0
    token_budget: int = 2048
    gamma: float = 1.0
    lam: float = 1.0
    weight_bucket_bytes: int = 256 << 20

    def engine(self, model_dir: str | Path) -> CriticEngine:
        """A fresh critic from the policy at ``model_dir`` (every build gives the same weights)."""
        return CriticEngine(
            model_dir, self.lr, self.value_clip, self.grad_clip, self.token_budget, self.weight_bucket_bytes
        )


def token_rewards(sample: Sample, algorithm: GRPOAlgorithm) -> torch.Tensor:
    """``[T]`` float64: the sequence reward on the last loss token, minus the per-token KL
    penalty when ``algorithm`` puts the KL in the reward."""
    mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
    rewards = torch.zeros(len(sample.response_ids), dtype=torch.float64)
    if algorithm.uses_reference and algorithm.kl_in == "reward":
        if len(sample.ref_logprobs) != len(sample.response_ids):
            raise ValueError(f"sample {sample.uid!r} has no reference log-probs (KL in the reward needs them)")
        behav = torch.tensor(sample.behav_logprobs, dtype=torch.float64)
        kl = kl_estimate(behav, torch.tensor(sample.ref_logprobs, dtype=torch.float64), algorithm.kl_estimator)
        rewards -= algorithm.kl_coef * torch.where(mask, kl, torch.zeros_like(kl))
    loss_tokens = mask.nonzero()
    if len(loss_tokens):
        rewards[int(loss_tokens[-1])] += sample.reward
    return rewards


def gae_targets(
    samples: Sequence[Sample], values: Sequence[Sequence[float]], algorithm: GRPOAlgorithm, gamma: float, lam: float
) -> tuple[list[list[float]], list[list[float]]]:
    """Per-token advantages (whitened over the step's loss tokens) and returns of ``samples``."""
    advantages, returns = [], []
    for s, v in zip(samples, values, strict=True):
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        adv, ret = gae(token_rewards(s, algorithm), torch.tensor(v, dtype=torch.float64), gamma, lam, mask)
        advantages.append(adv)
        returns.append(ret.tolist())
    return whiten([a.tolist() for a in advantages], [s.loss_mask for s in samples]), returns


def whiten(values: Sequence[Sequence[float]], masks: Sequence[Sequence[int]], eps: float = 1e-8) -> list[list[float]]:
    """``(x − mean) / (std + eps)`` with mean and population std over the masked-in entries of
    all rows; masked-out entries become 0."""
    flat = [x for row, mask in zip(values, masks, strict=True) for x, m in zip(row, mask, strict=True) if m]
    if not flat:
        return [[0.0] * len(row) for row in values]
    t = torch.tensor(flat, dtype=torch.float64)
    mean, std = float(t.mean()), float(t.std(unbiased=False))
    return [
        [(x - mean) / (std + eps) if m else 0.0 for x, m in zip(row, mask, strict=True)]
        for row, mask in zip(values, masks, strict=True)
    ]


@dataclass(frozen=True)
class StepShare:
    """A data-parallel rank's view of the step: every rank's samples and values in step order,
    and the positions in it of this rank's own (``train_global_batch``'s ``samples``)."""

    samples: Sequence[Sample]
    values: Sequence[Sequence[float]]
    mine: Sequence[int]


def critic_updates(
    critic: CriticEngine,
    samples: Sequence[Sample],
    returns: Sequence[Sequence[float]],
    values: Sequence[Sequence[float]],
    schedule: UpdateSchedule,
    parts: Sequence[tuple[Sequence[int], float | None]] | None = None,
) -> dict[str, float]:
    """The critic's value-regression updates of one step, on the actor's schedule of mini-batches
    and epochs; ``value_loss`` and ``value_grad_norm`` averaged over them, token counts summed.
    ``parts``: each mini-batch's indices into ``samples`` and its loss tokens over every rank
    (data parallelism); by default ``samples`` are the whole step."""
    if parts is None:
        parts = [(part, None) for part in mini_batch_ranges(len(samples), schedule.mini_batches)]
    updates = []
    for _ in range(schedule.epochs):
        for part, total in parts:
            sub = [samples[i] for i in part]
            returns_, values_ = [returns[i] for i in part], [values[i] for i in part]
            updates.append(critic.train_step(sub, returns_, values_, total_tokens=total))
    metrics = {}
    for key in ("value_loss", "value_clipped_tokens", "value_tokens", "value_grad_norm"):
        total = sum(u[key] for u in updates)
        metrics[key] = total / len(updates) if key in ("value_loss", "value_grad_norm") else total
    return metrics


def loss_token_mean(rows: Sequence[Sequence[float]], samples: Sequence[Sample]) -> float:
    """Mean of per-token ``rows`` over the samples' loss tokens (0 without any)."""
    picked = [x for row, s in zip(rows, samples, strict=True) for x, m in zip(row, s.loss_mask, strict=True) if m]
    return sum(picked) / len(picked) if picked else 0.0

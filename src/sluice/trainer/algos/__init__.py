"""Advantage estimators, by name.

Every entry maps ``(rewards [S], group_index [S], token_counts [S], eps) -> advantages [S]``:
one scalar per sample from its scalar reward, its prompt group (dense ids ``0..G-1``) and its
number of loss tokens (the weight of token-level statistics). The trainer broadcasts each
scalar to the sample's response tokens (``trainer/algorithm.py``). A new estimator is a new
file in this folder plus one entry in ``ADVANTAGE_ESTIMATORS``; nothing registers itself on
import. Group-relative estimators see one group at a time; ``WHOLE_BATCH_ESTIMATORS`` need the
whole step's batch (global whitening). ``gae`` needs a critic's values: PPO with a critic
computes it from them (``trainer/ppo.py``), and it raises here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sluice.trainer.algos.gae import gae
from sluice.trainer.algos.grpo import dr_grpo_advantages, grpo_advantages
from sluice.trainer.algos.reinforce_pp import reinforce_pp_advantages, reinforce_pp_baseline_advantages
from sluice.trainer.algos.rloo import rloo_advantages

AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
GroupEstimator = Callable[[torch.Tensor, float], torch.Tensor]


def per_group(estimate: GroupEstimator) -> AdvantageEstimator:
    """Lift a ``[groups, n] -> [groups, n]`` estimator to flat samples, one group at a time
    (groups may have unequal sizes)."""

    def flat(rewards: torch.Tensor, group_index: torch.Tensor, token_counts: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.zeros_like(rewards)
        for g in torch.unique(group_index).tolist():
            members = (group_index == g).nonzero().squeeze(1)
            out[members] = estimate(rewards[members].unsqueeze(0), eps)[0]
        return out

    flat.__doc__ = f"Per-group {estimate.__name__} over flat ``[samples]`` rewards."
    return flat


def gae_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, token_counts: torch.Tensor, eps: float
) -> torch.Tensor:
    """GAE needs per-token values from a critic: they are not in the rewards."""
    raise ValueError(
        "the 'gae' estimator needs per-token values from a critic: use trainer.algorithm=ppo "
        "(sluice.trainer.rl_step.train_global_batch with a critic), "
        "or call sluice.trainer.algos.gae(rewards, values, gamma, lam, mask)"
    )


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": per_group(grpo_advantages),
    "dr_grpo": per_group(dr_grpo_advantages),
    "rloo": per_group(lambda rewards, eps: rloo_advantages(rewards)),
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "gae": gae_advantages,
}

WHOLE_BATCH_ESTIMATORS = frozenset({"reinforce_pp", "reinforce_pp_baseline"})
NEEDS_VALUES = frozenset({"gae"})

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "NEEDS_VALUES",
    "WHOLE_BATCH_ESTIMATORS",
    "AdvantageEstimator",
    "dr_grpo_advantages",
    "gae",
    "grpo_advantages",
    "per_group",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
]

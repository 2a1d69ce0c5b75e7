"""Advantage estimators, by name.

Each entry maps ``(rewards [groups, n], eps) -> advantages [groups, n]``. A new estimator is
a new file in this folder plus one entry in ``ADVANTAGE_ESTIMATORS``; nothing registers
itself on import. Losses live in ``trainer/losses.py``, the glue in ``trainer/algorithm.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sluice.trainer.algos.grpo import dr_grpo_advantages, grpo_advantages

AdvantageEstimator = Callable[[torch.Tensor, float], torch.Tensor]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
}

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "dr_grpo_advantages", "grpo_advantages"]

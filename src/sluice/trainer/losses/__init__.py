"""Policy losses over three policies: current θ, proximal (prox) and behaviour (behav).

Role: per-token policy-gradient objectives on flattened ``[tokens]`` tensors (``LossInputs``),
each times the behaviour weight ``sg(π_prox / π_behav)`` (optionally truncated: TIS, token or
sequence level, cap or mask) and aggregated by a verl mode divided by a step-wide normaliser
(``common.py``), so a step's micro-batch losses and gradients add up exactly to one
full-batch pass. One file per family: ``ppo.py`` (decoupled PPO-clip, dual clip,
clip-higher), ``reinforce.py`` (CISPO, TOPR), ``gspo.py`` (sequence-level ratio).

``POLICY_LOSSES`` maps a config name to a loss; every loss takes ``inputs`` plus keyword
options (see each function). Stats are detached *sums*.

Deliberately not here: advantage estimation (``trainer/algos``), building the tensors from
samples (``engines/``, ``trainer/step.py``). The KL-to-reference and entropy terms are
added on top of any of these (``regularizers.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from sluice.api.types import LossInputs, LossOutputs
from sluice.trainer.losses.common import AGG_MODES, AggMode, TISLevel, TISMode, agg_normaliser, aggregate
from sluice.trainer.losses.gspo import gspo_loss
from sluice.trainer.losses.ppo import ppo_clip_loss
from sluice.trainer.losses.reinforce import cispo_loss, topr_loss

PolicyLoss = Callable[..., LossOutputs]

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip_loss,
    "cispo": cispo_loss,
    "gspo": gspo_loss,
    "topr": topr_loss,
}

# The options each loss accepts beyond the shared behaviour-weight / aggregation ones.
CLIPPED_LOSSES = ("ppo_clip", "cispo", "gspo")

__all__ = [
    "AGG_MODES",
    "CLIPPED_LOSSES",
    "POLICY_LOSSES",
    "AggMode",
    "LossInputs",
    "PolicyLoss",
    "TISLevel",
    "TISMode",
    "agg_normaliser",
    "aggregate",
    "cispo_loss",
    "gspo_loss",
    "ppo_clip_loss",
    "topr_loss",
]

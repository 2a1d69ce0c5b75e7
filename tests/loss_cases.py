"""Run a policy loss on plain-Python test inputs and return its output and d loss / d logp."""

from collections.abc import Callable
from typing import Any

import torch

from sluice.api.types import LossInputs, LossOutputs


def run_loss(fn: Callable[..., LossOutputs], d: dict, normaliser: float, **kw: Any) -> tuple[LossOutputs, list]:
    """``d`` holds float lists ``logp prox behav adv``, bools ``mask`` and optional ``lengths``."""
    logp = torch.tensor(d["logp"], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logp=logp,
        prox_logp=torch.tensor(d["prox"], dtype=torch.float64),
        behav_logp=torch.tensor(d["behav"], dtype=torch.float64),
        advantages=torch.tensor(d["adv"], dtype=torch.float64),
        mask=torch.tensor(d["mask"]),
        normaliser=normaliser,
        seq_lengths=torch.tensor(d["lengths"]) if "lengths" in d else None,
    )
    out = fn(inputs, **kw)
    out.loss.backward()
    assert logp.grad is not None
    return out, logp.grad.tolist()

"""The frozen reference policy (the initial model) that the KL term's log-probs come from.

The reference log-probs themselves are one DAG node (``reference_logprobs`` in
``dag/model_nodes.py``) served by a ``NodeTaskWorker`` beside rollout and training, which
builds its engine here. Deliberately not here: the KL estimators and how the KL enters the
objective (``trainer/losses/regularizers.py``), choosing which rows to train.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sluice.engines.hf_model import load_causal_lm
from sluice.engines.hf_train import HFTrainEngine


def frozen_engine(model_dir: str | Path, engine_kwargs: dict[str, Any]) -> HFTrainEngine:
    """The reference policy: the model at ``model_dir`` with gradients off (never stepped)."""
    engine = HFTrainEngine(load_causal_lm(model_dir), **{**engine_kwargs, "lr": 0.0, "lora": None})
    engine.model.requires_grad_(False)
    engine.model.eval()
    return engine

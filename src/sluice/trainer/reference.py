"""The reference step: log-probs of the frozen reference policy, as a TransferQueue task.

``ReferenceWorker`` owns a frozen copy of the initial policy and serves the ``reference`` task
(``ColumnTaskWorker``'s loop): it pulls rows as soon as rollout has written them (the same sample
columns the ``train`` task reads), computes every response token's log-prob under the
reference policy and writes them back as the ``ref_logprobs`` column; the ``train`` task lists
that column among its inputs, so the trainer sees a row only once its reference log-probs
exist. It runs beside the rollout and train workers (a thread with ``backend: local``, an actor
on Ray) and stops when the queue closes. ``reference_logprobs`` is the same step for a batch in hand (``mode: sync``).

Deliberately not here: the KL estimators and how the KL enters the objective
(``trainer/losses/regularizers.py``), choosing which rows to train.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sluice.api import Batch, QueueClient, Sample, TrainEngine
from sluice.engines.hf_model import load_causal_lm
from sluice.engines.hf_train import HFTrainEngine
from sluice.queue.samples import REF_COLUMN, SAMPLE_COLUMNS
from sluice.trainer.column_task import ColumnTaskWorker

REF_TASK = "reference"
REF_INPUT_COLUMNS = SAMPLE_COLUMNS
"""What the reference task reads: a whole written sample."""


def frozen_engine(model_dir: str | Path, engine_kwargs: dict[str, Any]) -> HFTrainEngine:
    """The reference policy: the model at ``model_dir`` with gradients off (never stepped)."""
    engine = HFTrainEngine(load_causal_lm(model_dir), **{**engine_kwargs, "lr": 0.0, "lora": None})
    engine.model.requires_grad_(False)
    engine.model.eval()
    return engine


def reference_logprobs(engine: TrainEngine, samples: Sequence[Sample], temperature: float) -> list[Sample]:
    """``samples`` with ``ref_logprobs`` filled in by ``engine`` (the frozen reference)."""
    ref = engine.logprobs(samples, temperature)
    return [dataclasses.replace(s, ref_logprobs=tuple(r)) for s, r in zip(samples, ref, strict=True)]


class ReferenceWorker(ColumnTaskWorker):
    """Serves the ``reference`` task of ``queue`` with a frozen copy of ``model_dir``."""

    task = REF_TASK
    output = REF_COLUMN

    def __init__(
        self,
        model_dir: str | Path,
        queue: QueueClient,
        engine_kwargs: dict[str, Any],
        *,
        batch_rows: int = 64,
        threads: int = 1,
    ) -> None:
        torch.set_num_threads(threads)
        super().__init__(queue, batch_rows)
        self.engine = frozen_engine(model_dir, engine_kwargs)

    def compute(self, batch: Batch, samples: Sequence[Sample]) -> list[list[float]]:
        return self.engine.logprobs(samples, self.engine.temperature)

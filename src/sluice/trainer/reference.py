"""The reference step: log-probs of the frozen reference policy, as a TransferQueue task.

``ReferenceWorker`` owns a frozen copy of the initial policy. Its ``serve`` loop pulls rows of
the ``reference`` task as soon as rollout has written them (the same sample columns the
``train`` task reads), computes every response token's log-prob under the reference policy and
writes them back as the ``ref_logprobs`` column; the ``train`` task lists that column among its
inputs, so the trainer sees a row only once its reference log-probs exist. It runs beside the
rollout and train workers (a thread with ``backend: local``, an actor on Ray) and stops when
the queue closes. ``reference_logprobs`` is the same step for a batch in hand (``mode: sync``).

Deliberately not here: the KL estimators and how the KL enters the objective
(``trainer/losses/regularizers.py``), choosing which rows to train.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sluice.api import QueueClient, Sample, TrainEngine
from sluice.engines.hf_model import load_causal_lm
from sluice.engines.hf_train import HFTrainEngine
from sluice.queue.samples import REF_COLUMN, SAMPLE_COLUMNS, rows_to_samples

REF_TASK = "reference"
REF_INPUT_COLUMNS = SAMPLE_COLUMNS
"""What the reference task reads: a whole written sample."""

logger = logging.getLogger(__name__)


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


class ReferenceWorker:
    """Serves the ``reference`` task of ``queue`` with a frozen copy of ``model_dir``."""

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
        self.engine = frozen_engine(model_dir, engine_kwargs)
        self.queue = queue
        self.batch_rows = batch_rows
        self.rows_done = 0

    def serve(self) -> int:
        """Write ``ref_logprobs`` for every row as it becomes ready, until the queue closes;
        returns the number of rows served."""
        while True:
            batch = self.queue.get(REF_TASK, REF_INPUT_COLUMNS, self.batch_rows, min_size=1)
            if not len(batch):  # closed
                return self.rows_done
            self.step(batch.indices, rows_to_samples(batch))

    def step(self, indices: Sequence[int], samples: Sequence[Sample]) -> None:
        """Reference log-probs of one batch of rows (``samples`` in ascending index order)."""
        ref = self.engine.logprobs(samples, self.engine.temperature)
        self.queue.put(sorted(indices), {REF_COLUMN: ref})
        self.rows_done += len(samples)

"""A scalar reward model's forwards: token-id rows → one score each (``[B]``).

The model is a Hugging Face ``...ForSequenceClassification`` with one label (``engines/hf_model.py``'s
``load_scalar_model``): its ``score`` head read at each row's last token that is not its
``pad_token_id``. Rows are right-padded with that id in length-sorted chunks of at most
``token_budget`` padded positions (``buckets_of``), so a row's score does not depend on which rows
share its chunk (to float rounding) and equals the model's forward of that row alone.
``scores`` runs without gradients (scoring a run's responses, validation); ``forward`` keeps the
graph (``sluice rm``'s Bradley–Terry loss, ``trainer/rm.py``). Deliberately not here: texts and
tokenisation (``rewards/reward_model.py``), losses, optimizers (``engines/hf_train.py`` steps it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from sluice.engines.response_tokens import buckets_of


def pad_id_of(model: Any) -> int:
    """The id rows are padded with: the model's ``pad_token_id``, past which it reads no token."""
    return int(model.config.pad_token_id)


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``[B, T]`` of right-padded ``rows``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, row in enumerate(rows):
        ids[k, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[k, : len(row)] = 1
    return ids.to(device), mask.to(device)


def forward(model: torch.nn.Module, rows: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """``[B]`` float32 scores of ``rows`` in one forward, with the graph."""
    device = next(model.parameters()).device
    ids, mask = pad_rows(rows, pad_id, device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, 1]
    return logits[:, 0].float()


def scores(
    model: torch.nn.Module,
    rows: Sequence[Sequence[int]],
    pad_id: int,
    token_budget: int,
    autocast: contextlib.AbstractContextManager[object] | None = None,
) -> list[float]:
    """Every row's score (no grad), in length-sorted chunks of at most ``token_budget`` positions."""
    out = [0.0] * len(rows)
    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast or contextlib.nullcontext():
        for chunk in buckets_of([len(r) for r in rows], token_budget):
            for i, value in zip(chunk, forward(model, [rows[i] for i in chunk], pad_id).tolist(), strict=True):
                out[i] = float(value)
    model.train(was_training)
    return out

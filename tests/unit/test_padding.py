"""The padded layout: right-padded model inputs and the indices of their response tokens."""

from __future__ import annotations

import pytest
import torch

from sluice.api.types import Sample
from sluice.engines.padding import pad_batch

torch.set_num_threads(1)


def sample(uid: int, n_prompt: int, n_resp: int, mask_first: bool = False) -> Sample:
    return Sample(
        uid=f"s{uid}",
        group_id=uid // 2,
        prompt_ids=tuple(range(1, 1 + n_prompt)),
        response_ids=tuple(range(10 + uid, 10 + uid + n_resp)),
        behav_logprobs=tuple(-0.1 * (j + 1) for j in range(n_resp)),
        token_versions=(0,) * n_resp,
        loss_mask=tuple(0 if (mask_first and j == 0) else 1 for j in range(n_resp)),
        reward=float(uid),
    )


def test_pad_batch_indexes_response_tokens() -> None:
    samples = [sample(0, 3, 4), sample(1, 1, 2), sample(2, 5, 0), sample(3, 2, 6)]
    b = pad_batch(samples, pad_id=0)
    assert b["input_ids"].shape == (4, 8) and b["attention_mask"].sum().item() == 7 + 3 + 5 + 8
    assert b["response_lengths"].tolist() == [4, 2, 0, 6]
    assert b["targets"].tolist() == [t for s in samples for t in s.response_ids]
    assert b["input_ids"][b["logit_rows"], b["logit_cols"] + 1].tolist() == b["targets"].tolist()
    assert b["response_mask"].sum().item() == 12
    assert b["input_ids"][b["response_mask"]].tolist() == b["targets"].tolist()
    assert b["behav_logprobs"].shape == b["loss_mask"].shape == (12,)
    assert b["input_ids"][1, 3:].tolist() == [0] * 5 and b["attention_mask"][1, 3:].sum().item() == 0
    with pytest.raises(ValueError):
        pad_batch([sample(0, 0, 2)])

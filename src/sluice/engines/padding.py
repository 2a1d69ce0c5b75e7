"""The padded layout of training forwards: right-padded ``prompt + response`` rows, one per sample.

Role: turn samples into model inputs (``pad_batch``) plus the index tensors that gather each
response token's logits, and flatten the per-response-token signals every layout shares
(``response_tensors``, also used by the packed layout in ``engines/packing.py``). The train engine
(``trainer.layout: padded``) and the critic run their forwards on these tensors.

Deliberately not here: choosing which samples share a forward (``engines/hf_train.length_buckets``),
micro-batch boundaries (``trainer/step.py``), model forwards and losses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.api.types import Sample


def pad_batch(samples: Sequence[Sample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad ``prompt + response`` sequences and index their response tokens.

    With ``B`` samples, ``T`` the longest sequence and ``N`` the total response tokens
    (sample order, then token order), the result holds:

    - ``input_ids`` ``[B, T]`` long, padded with ``pad_id``; ``attention_mask`` ``[B, T]`` long;
    - ``response_mask`` ``[B, T]`` bool, True where the token is a response token;
    - ``logit_rows``, ``logit_cols`` ``[N]`` long: the logits at ``[row, col]`` predict
      response token ``n`` (``col`` is one before the token's position);
    - ``targets`` ``[N]`` long: the response token ids;
    - ``loss_mask`` ``[N]`` bool and ``behav_logprobs`` ``[N]`` float32, flattened from the samples;
    - ``response_lengths`` ``[B]`` long, to split ``[N]`` back per sample.

    Every sample with a response needs a non-empty prompt (its first token is predicted by
    the last prompt position).
    """
    if not samples:
        raise ValueError("pad_batch needs at least one sample")
    width = max(s.num_tokens for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    response_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    rows: list[int] = []
    cols: list[int] = []
    for b, s in enumerate(samples):
        n_prompt, n_resp = len(s.prompt_ids), len(s.response_ids)
        if n_resp and not n_prompt:
            raise ValueError(f"sample {s.uid!r} has a response but an empty prompt")
        if not len(s.behav_logprobs) == len(s.loss_mask) == n_resp:
            raise ValueError(f"sample {s.uid!r}: behav_logprobs / loss_mask do not match the response")
        input_ids[b, : s.num_tokens] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention_mask[b, : s.num_tokens] = 1
        response_mask[b, n_prompt : s.num_tokens] = True
        rows.extend([b] * n_resp)
        cols.extend(range(n_prompt - 1, s.num_tokens - 1))
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "logit_rows": torch.tensor(rows, dtype=torch.long),
        "logit_cols": torch.tensor(cols, dtype=torch.long),
        **response_tensors(samples),
    }


def response_tensors(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """The per-response-token signals of ``samples`` flattened in order (any layout): ``targets``,
    ``loss_mask``, ``behav_logprobs`` ``[N]`` and ``response_lengths`` ``[B]``."""
    return {
        "targets": torch.tensor([t for s in samples for t in s.response_ids], dtype=torch.long),
        "loss_mask": torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.bool),
        "behav_logprobs": torch.tensor([x for s in samples for x in s.behav_logprobs], dtype=torch.float32),
        "response_lengths": torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long),
    }

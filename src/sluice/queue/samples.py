"""The column schema of a trained sample: ``Sample`` ⇄ TransferQueue rows.

Row ``group_id * group_size + k`` holds sample ``k`` of a group; its columns are the fields
of ``Sample``, variable-length ones as plain lists (stored without padding). Rollout writes
them; the trainer reads them back. Nothing here talks to a queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sluice.api import Batch, RowMeta, Sample

SAMPLE_COLUMNS = (
    "uid",
    "prompt_ids",
    "response_ids",
    "behav_logprobs",
    "token_versions",
    "loss_mask",
    "reward",
    "meta",
)
"""What the ``train`` task reads."""

REF_COLUMN = "ref_logprobs"
"""Per-response-token log-probs of the frozen reference policy, written by the ``reference``
task (the ``reference_logprobs`` DAG node); the ``train`` task reads it too when the loss has a KL term."""


def train_columns(with_reference: bool) -> tuple[str, ...]:
    """The ``train`` task's input columns: the sample's, plus ``ref_logprobs`` when a KL needs them."""
    return (*SAMPLE_COLUMNS, REF_COLUMN) if with_reference else SAMPLE_COLUMNS


def group_rows(group_id: int, group_size: int) -> list[int]:
    return list(range(group_id * group_size, (group_id + 1) * group_size))


def samples_to_rows(
    samples: Sequence[Sample], group_size: int
) -> tuple[list[int], dict[str, list[Any]], list[RowMeta]]:
    """Indices, columns and row metadata of one group's samples (in sample order)."""
    if not samples:
        return [], {c: [] for c in SAMPLE_COLUMNS}, []
    group_id = samples[0].group_id
    indices = group_rows(group_id, group_size)[: len(samples)]
    columns: dict[str, list[Any]] = {
        "uid": [s.uid for s in samples],
        "prompt_ids": [list(s.prompt_ids) for s in samples],
        "response_ids": [list(s.response_ids) for s in samples],
        "behav_logprobs": [list(s.behav_logprobs) for s in samples],
        "token_versions": [list(s.token_versions) for s in samples],
        "loss_mask": [list(s.loss_mask) for s in samples],
        "reward": [s.reward for s in samples],
        "meta": [dict(s.meta) for s in samples],
    }
    meta = [
        RowMeta(index=i, group_id=group_id, version=s.version, num_tokens=s.num_tokens, group_size=group_size)
        for i, s in zip(indices, samples, strict=True)
    ]
    return indices, columns, meta


def rows_to_samples(batch: Batch) -> list[Sample]:
    """Rebuild ``Sample`` s from a batch read with ``SAMPLE_COLUMNS`` (and maybe ``REF_COLUMN``), in
    index order."""
    cols = batch.columns
    order = sorted(range(len(batch)), key=lambda k: batch.indices[k])
    return [
        Sample(
            uid=cols["uid"][k],
            group_id=batch.meta[k].group_id,
            prompt_ids=tuple(cols["prompt_ids"][k]),
            response_ids=tuple(cols["response_ids"][k]),
            behav_logprobs=tuple(cols["behav_logprobs"][k]),
            token_versions=tuple(cols["token_versions"][k]),
            loss_mask=tuple(cols["loss_mask"][k]),
            reward=float(cols["reward"][k]),
            meta=dict(cols["meta"][k]),
            ref_logprobs=tuple(cols[REF_COLUMN][k]) if REF_COLUMN in cols else (),
        )
        for k in order
    ]

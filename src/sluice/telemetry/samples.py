"""A few of a step's trained samples, shown as text: chosen where the samples are, decoded at the run.

The trainer worker holds its step's samples; ``summarize_samples`` keeps ``count`` of them spread
over the step (token ids, reward, version, group: small and picklable, so a Ray trainer returns
them cheaply), and the run decodes them with its tokenizer (``sample_rows``) into the records of
``samples.jsonl`` and the trackers' sample tables (``telemetry/trackers.py``'s ``SAMPLE_COLUMNS``).

It deliberately does not write anything or decide when a step's samples are due.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sluice.api import Sample


@dataclass(frozen=True)
class SampleSummary:
    """One trained sample as token ids and the numbers shown beside it."""

    uid: str
    group_id: int
    version: int
    """The policy version it was generated under (its oldest token's)."""
    reward: float
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    rm_score: float | None = None
    """The reward model's score before combining (``reward.model``; ``None``: none)."""


class TokenDecoder(Protocol):
    """What decoding needs of a tokenizer (an HF tokenizer is one)."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def summarize_samples(samples: Sequence[Sample], count: int) -> list[SampleSummary]:
    """``count`` samples spread evenly over ``samples`` (in their order; all when fewer)."""
    n = len(samples)
    chosen = [samples[k * n // count] for k in range(count)] if n > count else list(samples)
    return [
        SampleSummary(
            s.uid,
            s.group_id,
            s.version,
            float(s.reward),
            tuple(s.prompt_ids),
            tuple(s.response_ids),
            s.meta.get("rm_score"),
        )
        for s in chosen
    ]


def sample_rows(step: int, summaries: Sequence[SampleSummary], tokenizer: TokenDecoder) -> list[dict[str, Any]]:
    """The records of ``samples.jsonl``: text, reward, version and staleness (the version the step
    trained, ``step - 1``, minus the sample's; the convention of the train records). The prompt
    keeps its special tokens (the chat template's role markers and BOS are what the model saw);
    the response drops them (its closing EOS says nothing)."""
    return [
        {
            "step": step,
            "group_id": s.group_id,
            "uid": s.uid,
            "version": s.version,
            "staleness": step - 1 - s.version,
            "reward": s.reward,
            "prompt": tokenizer.decode(s.prompt_ids, skip_special_tokens=False),
            "response": tokenizer.decode(s.response_ids, skip_special_tokens=True),
            **({"rm_score": s.rm_score} if s.rm_score is not None else {}),
        }
        for s in summaries
    ]

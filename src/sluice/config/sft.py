"""The ``sft`` config section: what ``sluice sft`` trains on and for how long.

Supervised fine-tuning reads the same ``data`` section as ``sluice train`` (files, ``prompt_key``,
chat template, system prompt) and the same ``trainer`` section (lr, schedule, strategy, dtype,
LoRA, micro-batch tokens); this section adds only what SFT alone needs: where a row's
conversation or response is, which tokens carry the loss, how many passes, how rows longer than
the context are treated. Only declares and validates; ``data/conversations.py`` renders rows and
``sft/`` trains.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sluice.config.section import Section as _Section


class SftConfig(_Section):
    messages_key: str = "messages"
    """Dotted path of a conversation (a list of ``{"role", "content"}``; TRL's conversational
    format). A row without it is a prompt / completion row (``data.prompt_key`` and
    ``response_key``)."""

    response_key: str = "completion"
    """Dotted path of the response of a prompt / completion row: a string, or assistant messages
    (TRL's ``completion``; verl's SFT parquet: e.g. ``extra_info.answer`` with
    ``data.prompt_key=extra_info.question``)."""

    train_on: Literal["assistant", "completion", "all"] = "assistant"
    """Which tokens carry the loss: ``assistant`` (every assistant turn, with its end-of-turn
    tokens), ``completion`` (the last assistant turn only: the completion), ``all`` (every token
    after the first)."""

    epochs: float = Field(default=1.0, gt=0.0)
    """Passes over the training rows (a fraction stops part-way through the last pass), each in
    a fresh seeded order. ``steps`` instead, when set."""

    steps: int | None = Field(default=None, ge=1)
    """Optimizer steps to run instead of ``epochs`` (the rows repeat, reshuffled, as needed)."""

    batch_size: int = Field(default=32, ge=1)
    """Rows per optimizer step (cut into micro-batches of ``trainer.micro_batch_tokens``)."""

    max_length: int | None = Field(default=None, ge=2)
    """Longest row in tokens after the chat template; longer rows follow ``long_rows``. ``null``:
    the model's ``max_position_embeddings``."""

    long_rows: Literal["filter", "error"] = "filter"
    """A row over ``max_length``: ``filter`` drops it (counted and logged, with its first rows
    named), ``error`` stops naming it."""

    @model_validator(mode="after")
    def _epochs_or_steps(self) -> SftConfig:
        if self.steps is not None and "epochs" in self.model_fields_set:
            raise ValueError(f"sft.epochs ({self.epochs:g}) and sft.steps ({self.steps}) exclude each other")
        return self

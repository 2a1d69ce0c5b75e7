"""The ``rm`` config section: what ``sluice rm`` trains a reward model on and for how long.

``sluice rm`` reads the same ``data`` section as ``sluice sft`` (files, ``prompt_key``, chat
template, system prompt) and the same ``trainer`` section (lr, schedule, strategy, dtype,
micro-batch tokens); this section adds only what preference pairs need: where a row's chosen and
rejected responses are, how many passes, how pairs longer than ``max_length`` are treated. Only
declares and validates; ``data/preferences.py`` renders pairs and ``trainer/rm.py`` trains.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sluice.config.section import Section as _Section


class RmConfig(_Section):
    chosen_key: str = "chosen"
    """Dotted path of the preferred response (TRL's ``chosen``): a string, or chat messages (the
    whole conversation, or only the assistant turns when the row has a ``data.prompt_key``)."""

    rejected_key: str = "rejected"
    """Dotted path of the dispreferred response (TRL's ``rejected``), in the form of ``chosen``."""

    epochs: float = Field(default=1.0, gt=0.0)
    """Passes over the training pairs (a fraction stops part-way through the last pass), each in a
    fresh seeded order. ``steps`` instead, when set."""

    steps: int | None = Field(default=None, ge=1)
    """Optimizer steps to run instead of ``epochs`` (the pairs repeat, reshuffled, as needed)."""

    batch_size: int = Field(default=32, ge=1)
    """Pairs per optimizer step (their forwards cut into chunks of ``trainer.micro_batch_tokens``)."""

    max_length: int | None = Field(default=None, ge=2)
    """Longest chosen or rejected sequence in tokens after the chat template; a longer pair follows
    ``long_rows``. ``null``: the model's ``max_position_embeddings``."""

    long_rows: Literal["filter", "error"] = "filter"
    """A pair over ``max_length``: ``filter`` drops it (counted and logged), ``error`` stops naming it."""

    @model_validator(mode="after")
    def _epochs_or_steps(self) -> RmConfig:
        if self.steps is not None and "epochs" in self.model_fields_set:
            raise ValueError(f"rm.epochs ({self.epochs:g}) and rm.steps ({self.steps}) exclude each other")
        return self

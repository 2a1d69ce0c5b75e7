"""Config sections of what a run learns from and is judged on: the model folder, the built-in task,
the user's own data files (how their rows map to prompts, chat rendering, length limits) and the
evaluation. Only declares and validates; reading files is ``data/``'s job.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from sluice.config.section import Section as _Section


class ModelConfig(_Section):
    path: str | None = None
    """Local Hugging Face model folder (config.json, weights, tokenizer.json). ``null`` uses the
    embedded default: the task's tiny Llama, SFT-warm-started once and cached under ``cache_dir``."""

    cache_dir: str = ".cache/sluice"
    """Where the embedded default base model is built and cached (relative to the working dir)."""


class TaskConfig(_Section):
    name: str = "reverse_digits"
    """Built-in task (see ``sluice.tasks.TASKS``): its dataset generator, reward and evaluator."""

    train_prompts: int = Field(default=20000, ge=1)
    """How many RL training prompts the task generates (disjoint from the held-out set)."""

    eval_prompts: int = Field(default=500, ge=1)
    """Size of the task's fixed held-out set (used when ``data.val_files`` is empty)."""


def _as_tuple(value: Any) -> Any:
    return (value,) if isinstance(value, str) else value


def _on_off(value: Any) -> Any:
    """YAML reads a bare ``on`` / ``off`` as a boolean: take it as the word."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class DataConfig(_Section):
    train_files: tuple[str, ...] = ()
    """Training rows: JSONL / JSON / parquet files or ``datasets`` folders (``save_to_disk``),
    one path or a list. Empty: the built-in task generates them."""

    val_files: tuple[str, ...] = ()
    """Validation rows (same formats), what every evaluation runs on. Empty with ``train_files``
    set: no evaluation; empty without: the built-in task's held-out set."""

    prompt_key: str = "prompt"
    """Dotted path of the prompt in a row: a string, or chat messages (a list of
    ``{"role", "content"}``; verl's schema)."""

    answer_key: str | None = None
    """Dotted path of the reference answer, passed to the reward as ``answer`` (a number becomes
    its string, ``72.0`` → ``"72"``; other non-strings are an error). ``null``: ``answer`` if the
    row has it, else ``reward_model.ground_truth`` (verl's schema)."""

    data_source_key: str = "data_source"
    """Dotted path of the row's source name (routes ``reward.by_source`` and splits evaluation
    per source); rows without it belong to source ``default``."""

    fields: dict[str, str] = Field(default_factory=dict)
    """More reward fields: ``{name: dotted path}`` (e.g. ``{tests: extra_info.tests}``), passed to
    the reward by name."""

    max_prompt_length: int | None = Field(default=None, ge=1)
    """Longest prompt in tokens (after the chat template); longer ones follow ``long_prompts``.
    ``null``: the model's ``max_position_embeddings`` minus ``rollout.max_new_tokens``."""

    long_prompts: Literal["filter", "error"] = "filter"
    """A prompt over ``max_prompt_length``: ``filter`` drops it (counted, logged), ``error``
    stops the run naming its row."""

    chat_template: Literal["auto", "on", "off"] = "auto"
    """Render prompts with the tokenizer's chat template (with the generation prompt): ``auto``
    when the tokenizer has one, ``on`` always (an error if it has none), ``off`` never (raw
    completion models; message-list prompts then need a template)."""

    system_prompt: str | None = None
    """A system message put before each prompt's messages (chat template only)."""

    _one_path = field_validator("train_files", "val_files", mode="before")(_as_tuple)
    _yaml_on_off = field_validator("chat_template", mode="before")(_on_off)


class EvalConfig(_Section):
    samples: int = Field(default=0, ge=0)
    """Sampled evaluation: ``k`` responses per prompt at ``temperature``, reported as mean@k (mean
    reward of the ``k``) and pass@k (share of prompts with a correct one: reward ≥ 1) beside greedy
    accuracy, overall and per data source (0: greedy only)."""

    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature of the ``samples`` responses."""

    max_prompts: int | None = Field(default=None, ge=1)
    """Evaluate on the first this many validation rows (``null``: all)."""

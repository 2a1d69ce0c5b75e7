"""``sluice init``: a first run config from a model folder and a data file, guessed and checked.

It reads the data's schema (the ``data`` section's readers: JSONL, JSON, parquet, ``datasets``
folders), the model's context length and chat template, guesses the row mapping (the prompt:
a string or chat messages, verl's schema included; the answer, dotted paths such as
``reward_model.ground_truth``; the source) from ``data/mapping.py``'s ``LIKELY_COLUMNS``, the
response cap from the context left after the longest prompt, and one pass as the run's length.
It then checks a handful of rows end to end as a run would (map, render, tokenise, length against
the context, one reward call when a reward is named) and writes a commented YAML config that
``sluice train`` reads as it is (it is read back with the same loader before ``init`` returns).
``key=value`` overrides win over every guess and are written as given.

It deliberately does not train, download or change the data; every guess is said with its reason
(``Guess.why``) so the user can correct it with an override.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.config import ConfigError, SluiceConfig, load_config
from sluice.config.loading import parse_override, set_dotted, validate_config
from sluice.data.mapping import ANSWER_PATHS, LIKELY_COLUMNS, lookup
from sluice.data.readers import DatasetError, RowSet, read_rows

CHECKED_ROWS = 8
"""Rows checked end to end (mapped, rendered, tokenised, held to the context)."""
MEASURED_ROWS = 256
"""Rows whose rendered prompt length sets the response cap's guess."""
MAX_RESPONSE = 1024
"""The response cap's guess is at most this many tokens (the context permitting)."""
PROMPT_SLACK = 1.25
"""The response cap leaves the prompts this many times the longest measured one (rows past the
measured ones may be a little longer; longer still are dropped and counted, ``data.long_prompts``)."""
PROMPTS_PER_STEP = 32
"""``rollout.prompts_per_step``'s guess (fewer when the data has fewer rows)."""
SECTIONS = ("model", "data", "reward", "rollout", "run")
"""The written sections, in order (any other an override names follows them)."""


@dataclass(frozen=True)
class Guess:
    """One written config value and why it was chosen."""

    key: str
    """Dotted config key, e.g. ``data.prompt_key``."""
    value: Any
    why: str


@dataclass(frozen=True)
class InitResult:
    path: Path
    """The config written."""
    guesses: list[Guess]
    checks: list[str]
    """What the end-to-end check of the rows found, one line each."""


def init_config(
    model: str,
    data: str,
    out: str | Path = "my_run.yaml",
    val: str | None = None,
    reward: str | None = None,
    overrides: Sequence[str] = (),
) -> InitResult:
    """Guess, check and write ``out``; raises ``ConfigError`` / ``DatasetError`` /
    ``ModelPathError`` naming what is wrong (nothing is written then)."""
    from sluice.engines.model_folder import check_model_dir

    out = Path(out)
    load_config(None, list(overrides))  # a wrong key is said before the data and the model are read
    given = dict(parse_override(item) for item in overrides)
    check_model_dir(model)
    rows = read_rows(data)
    if not rows.rows:
        raise DatasetError(f"dataset is empty: no rows in {rows.source}")
    guesses = [Guess("model.path", _path_for(model, out), "the model folder given (--model)")]
    guesses += _files(data, val, out)
    mapping = _mapping(rows.rows[0], given)
    prompt_key = str(given.get("data.prompt_key", mapping[0].value))
    from sluice.engines.hf_model import load_tokenizer

    tokenizer = load_tokenizer(model)
    guesses += [*mapping, *_lengths(model, tokenizer, rows, prompt_key, given)]
    guesses += _reward(reward, out)
    guesses += _sizes(len(rows.rows), given)
    guesses.append(Guess("run.name", out.stem, f"named after the config: outputs in runs/{out.stem}/"))
    guesses = [g for g in guesses if g.key not in given]
    config = _validated(guesses, given, out)
    checks = _check_rows(config, tokenizer, rows)
    if val is not None:  # the same mapping must read the validation rows
        checks += _check_rows(config, tokenizer, read_rows(val), reward=False)
    out.write_text(_yaml(guesses, given, model, data))
    load_config(out)  # as `sluice train` reads it
    return InitResult(out, guesses, checks)


def _path_for(path: str, out: Path) -> str:
    """``path`` as the config holds it: as given when the config lands in the working directory
    (where ``sluice train`` resolves it), else absolute."""
    same_folder = out.resolve().parent == Path.cwd().resolve()
    return path if same_folder or Path(path).is_absolute() else str(Path(path).resolve())


def _files(data: str, val: str | None, out: Path) -> list[Guess]:
    found = [Guess("data.train_files", _path_for(data, out), "the training rows given (--data)")]
    if val is None:
        return [*found, Guess("run.eval_every", 0, "no --val file: nothing to evaluate on")]
    return [*found, Guess("data.val_files", _path_for(val, out), "the validation rows given (--val)")]


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)
    )


def _candidates(row: dict[str, Any], names: Sequence[str]) -> list[str]:
    """Dotted paths of ``row`` named like ``names`` (top level first, then one level down)."""
    top = [n for n in names if n in row]
    nested = [f"{col}.{n}" for n in names for col, sub in row.items() if isinstance(sub, dict) and n in sub]
    return top + nested


def _mapping(row: dict[str, Any], given: dict[str, Any]) -> list[Guess]:
    """``data.prompt_key`` / ``answer_key`` / ``data_source_key`` for the first row's schema."""
    columns = ", ".join(map(str, row))
    prompt = given.get("data.prompt_key")
    if prompt is None:
        usable = [p for p in _candidates(row, LIKELY_COLUMNS["data.prompt_key"]) if _prompt_like(lookup(row, p))]
        if not usable:
            raise DatasetError(
                f"row 1: no prompt column among {columns}: name it, e.g. `sluice init ... data.prompt_key=COLUMN`"
            )
        prompt = usable[0]
    value = lookup(row, prompt)
    kind = "a list of chat messages (verl's schema)" if _is_messages(value) else "text"
    found = [Guess("data.prompt_key", prompt, f"column {prompt!r} holds {kind}; row keys: {columns}")]
    if "data.answer_key" not in given:
        found.append(_answer(row, str(prompt), columns))
    source = lookup(row, "data_source")
    if isinstance(source, str):
        found.append(Guess("data.data_source_key", "data_source", f"rows name their source ({source!r} in row 1)"))
    else:
        found.append(Guess("data.data_source_key", "data_source", "rows name no source: all are source 'default'"))
    return found


def _prompt_like(value: Any) -> bool:
    return (isinstance(value, str) and bool(value.strip())) or _is_messages(value)


def _answer(row: dict[str, Any], prompt: str, columns: str) -> Guess:
    for path in ANSWER_PATHS:  # what `answer_key: null` reads
        if isinstance(lookup(row, path), str | int | float) and path != prompt:
            return Guess("data.answer_key", path, f"{path!r} holds the reference answer")
    names = [n for n in LIKELY_COLUMNS["data.answer_key"] if n not in ANSWER_PATHS]
    for path in _candidates(row, names):
        if path != prompt and isinstance(lookup(row, path), str | int | float):
            return Guess("data.answer_key", path, f"{path!r} is the likeliest answer column; row keys: {columns}")
    raise DatasetError(
        f"row 1: no answer column among {columns} (tried {', '.join(LIKELY_COLUMNS['data.answer_key'])}, "
        "reward_model.ground_truth): name it, e.g. `sluice init ... data.answer_key=COLUMN`"
    )


def _lengths(model: str, tokenizer: Any, rows: RowSet, key: str, given: dict[str, Any]) -> list[Guess]:
    """The chat template's use and the response cap: the context left after the longest of the
    first ``MEASURED_ROWS`` prompts, at most ``MAX_RESPONSE``."""
    from sluice.data.chat import ChatRenderer
    from sluice.data.mapping import require
    from sluice.data.prompts import model_context

    has_template = bool(getattr(tokenizer, "chat_template", None))
    found = [
        Guess(
            "data.chat_template",
            "auto",
            "the tokenizer has a chat template: prompts are rendered with it"
            if has_template
            else "the tokenizer has no chat template: prompts are tokenised as they are",
        )
    ]
    if "rollout.max_new_tokens" in given:
        return found
    renderer = ChatRenderer(tokenizer, str(given.get("data.chat_template", "auto")), given.get("data.system_prompt"))
    longest = 0
    for k, row in enumerate(rows.rows[:MEASURED_ROWS]):
        text = renderer.render(require(row, key, rows.where(k), "prompt", "data.prompt_key"), rows.where(k), key)
        longest = max(longest, len(renderer.encode(text)))
    context = model_context(model)
    if context is None:
        why = f"the model's config.json gives no max_position_embeddings; longest prompt {longest} tokens"
        return [*found, Guess("rollout.max_new_tokens", MAX_RESPONSE, why)]
    room = context - math.ceil(PROMPT_SLACK * longest)
    if room < 1:
        raise ConfigError(
            f"{rows.source}: a prompt of {longest} tokens fills the model's context ({context} tokens): "
            "no room for a response; set data.max_prompt_length to drop the long ones"
        )
    cap = min(MAX_RESPONSE, room)
    measured = min(len(rows.rows), MEASURED_ROWS)
    why = f"context {context} - {PROMPT_SLACK:g} x the longest prompt ({longest} tokens, of the first {measured} rows)"
    return [*found, Guess("rollout.max_new_tokens", cap, f"{why}, at most {MAX_RESPONSE}")]


def _reward(reward: str | None, out: Path) -> list[Guess]:
    from sluice.rewards import REWARDS

    if reward is None:
        return [Guess("reward.name", "exact_match", "no --reward: the response must equal the answer (edit me)")]
    if reward in REWARDS:
        return [Guess("reward.name", reward, "the built-in reward given (--reward)")]
    file, sep, attr = reward.rpartition(":")
    if not sep or not file or not attr:
        raise ConfigError(f"--reward {reward!r}: expected path/to/file.py:function, module:function or a built-in name")
    if file.endswith(".py") and not Path(file).is_absolute():  # the loader anchors it at the config's folder
        file = os.path.relpath(Path(file).resolve(), out.resolve().parent)
    return [Guess("reward.fn", f"{file}:{attr}", "the reward function given (--reward)")]


def _sizes(rows: int, given: dict[str, Any]) -> list[Guess]:
    per_step = int(given.get("rollout.prompts_per_step") or min(PROMPTS_PER_STEP, rows))
    why = f"{PROMPTS_PER_STEP} prompts a step" if rows >= PROMPTS_PER_STEP else f"every one of the {rows} rows a step"
    steps = math.ceil(rows / per_step)
    return [
        Guess("rollout.prompts_per_step", per_step, why),
        Guess("run.steps", steps, f"one pass over the {rows} training rows at {per_step} prompts a step"),
    ]


def _validated(guesses: list[Guess], given: dict[str, Any], out: Path) -> SluiceConfig:
    """The config the guesses and overrides make, validated as ``load_config`` would read it."""
    data: dict[str, Any] = {}
    for key, value in [*((g.key, g.value) for g in guesses), *given.items()]:
        set_dotted(data, key, value)
    fn = data.get("reward", {}).get("fn")
    file, _, attr = str(fn).rpartition(":")
    if fn and file.endswith(".py") and not Path(file).is_absolute():
        data["reward"]["fn"] = f"{(out.resolve().parent / file).resolve()}:{attr}"
    config = validate_config(data)
    from sluice.preflight import preflight

    preflight(config, reward_given=False)
    return config


def _check_rows(config: SluiceConfig, tokenizer: Any, rows: RowSet, reward: bool = True) -> list[str]:
    """The first ``CHECKED_ROWS`` rows of ``rows`` as a run reads them, and with ``reward`` one
    reward call on the first (its own answer as the response)."""
    from sluice.data.prompts import PromptBuilder, prompt_limit
    from sluice.rewards import resolve_reward

    assert config.model.path is not None and config.rollout.max_new_tokens is not None
    limit = prompt_limit(config.data, config.model.path, config.rollout.max_new_tokens)
    head = RowSet(rows.source, rows.rows[:CHECKED_ROWS], rows.numbers[:CHECKED_ROWS], rows.unit)
    built = PromptBuilder(config.data, tokenizer, limit).build(head)
    first = built.items[0]
    lines = [
        f"checked {len(head.rows)} of {len(rows.rows)} rows of {rows.source}: mapped, rendered, tokenised; "
        f"{len(built.items)} fit the prompt limit ({limit or 'none'})",
        f"row 1 as the model sees it ({len(first.prompt_ids)} tokens): {first.prompt!r:.200}",
    ]
    if not reward:
        return lines[:1]
    fn = resolve_reward(config.reward, None)
    fields = dict(first.fields)
    score = fn(str(fields["answer"]), **fields)
    if not isinstance(score, bool | int | float):
        raise ConfigError(f"reward: returned {type(score).__name__} {score!r:.80} for row 1, expected a number")
    lines.append(f"reward on row 1 with its own answer as the response: {float(score):g}")
    return lines


def _yaml(guesses: list[Guess], given: dict[str, Any], model: str, data: str) -> str:
    """The config's text: one commented line per key of a section (deeper keys as a flow mapping),
    sections in ``SECTIONS`` order."""
    entries: dict[str, dict[str, tuple[Any, str]]] = {}
    for key, value, why in [*((g.key, g.value, g.why) for g in guesses), *((k, v, "given") for k, v in given.items())]:
        section, name, *deeper = key.split(".")
        held, said = entries.setdefault(section, {}).get(name, ({}, why))
        if deeper:  # data.fields.tests=... : one mapping under data.fields
            merged: dict[str, Any] = held if isinstance(held, dict) else {}
            set_dotted(merged, ".".join(deeper), value)
            value = merged
        entries[section][name] = (value, said)
    today = datetime.date.today().isoformat()
    lines = [
        f"# Written by `sluice init --model {model} --data {data}` ({today}); each value says why it was chosen.",
        "# Every key: `sluice config-docs` (docs/config.md). First: sluice train THIS_FILE run.steps=2",
    ]
    for section in [*SECTIONS, *sorted(set(entries) - set(SECTIONS))]:
        if section in entries:
            lines.append(f"{section}:")  # a value in JSON: YAML reads it as it is
            lines += [f"  {name}: {json.dumps(value)}  # {why}" for name, (value, why) in entries[section].items()]
    return "\n".join(lines) + "\n"

"""Resolve a run's configuration: YAML file + dotted ``key=value`` overrides → ``SluiceConfig``.

Every failure becomes one ``ConfigError`` whose message names the offending field, so the CLI
can print it without a traceback. This module does not know what the fields mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sluice.config.models import SluiceConfig
from sluice.config.peer_names import suggest


class ConfigError(ValueError):
    """A configuration problem, with a message that names the field."""


def load_config(
    path: str | Path | Sequence[str | Path] | None = None, overrides: list[str] | None = None
) -> SluiceConfig:
    """Read ``path`` (YAML, optional; several files are merged in order, a later file's keys over
    an earlier one's, section by section), apply ``a.b=value`` overrides, validate."""
    data: dict[str, Any] = {}
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    for one in paths:
        layer = _read_yaml(Path(one))
        _anchor_reward_files(layer, Path(one).parent)
        data = merge_layers(data, layer)
    for item in overrides or []:
        key, value = parse_override(item)
        refuse_moved(key)
        set_dotted(data, key, value)
    _anchor_reward_files(data, Path.cwd())  # an override's file: Ray workers run in other directories
    return validate_config(data)


def merge_layers(base: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """``layer`` over ``base``: mappings merge key by key, anything else (numbers, lists) is replaced."""
    merged = dict(base)
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_layers(merged[key], value)
        else:
            merged[key] = value
    return merged


MOVED = {
    "trainer.data_parallel": "resources.trainer.ranks",
    "run.trainer_threads": "resources.trainer.threads",
    "run.rollout_threads": "resources.rollout.threads",
    "rollout.replicas": "resources.rollout.replicas",
    "fleet.replica_actors": "resources.rollout.replica_actors",
}
"""Options that moved (old dotted name → new one): a config naming an old one is refused with
one message naming the replacement, never silently translated."""


def refuse_moved(key: str) -> None:
    """``ConfigError`` naming the replacement when ``key`` is an option that moved."""
    if key in MOVED:
        raise ConfigError(f"{key} was moved: use {MOVED[key]}")


def _refuse_moved_in(data: dict[str, Any]) -> None:
    for old in MOVED:
        section, _, name = old.partition(".")
        node = data.get(section)
        if isinstance(node, dict) and name in node:
            refuse_moved(old)


def validate_config(data: dict[str, Any]) -> SluiceConfig:
    _refuse_moved_in(data)
    try:
        return SluiceConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def steps_of_epochs(cfg: SluiceConfig, prompts: int) -> SluiceConfig:
    """``cfg`` with ``run.epochs`` turned into ``run.steps`` over ``prompts`` training prompts
    (``ceil(epochs × prompts ÷ rollout.prompts_per_step)``, at least 1), validated again (the
    warmup must fit the derived steps); ``cfg`` itself without ``run.epochs``."""
    epochs = cfg.run.epochs
    if epochs is None:
        return cfg
    steps = max(1, math.ceil(epochs * prompts / cfg.rollout.prompts_per_step))
    data = cfg.model_dump()
    data["run"] = {**data["run"], "steps": steps, "epochs": None}
    return validate_config(data)


def dump_config(cfg: SluiceConfig, leave_out: Sequence[str] = ()) -> str:
    """``cfg`` as YAML; the ``leave_out`` sections are named in a first comment line instead."""
    data = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in leave_out}
    head = f"# not read by this run, left out: {', '.join(leave_out)}\n" if leave_out else ""
    return head + yaml.safe_dump(data, sort_keys=False)


def read_utf8(path: Path, error: type[Exception]) -> str:
    """The file's text; bytes that are not UTF-8 raise ``error`` naming the file and 1-based line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise error(f"{path} line {line}: not UTF-8 text (byte {raw[err.start]:#04x})") from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = read_utf8(path, ConfigError)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _anchor_reward_files(data: dict[str, Any], folder: Path) -> None:
    """A reward given by a relative file path (``my_rewards.py:fn``) is made absolute against
    ``folder``: the config file's for its own values, then the working directory for overrides."""
    reward = data.get("reward")
    if not isinstance(reward, dict):
        return

    def anchored(ref: Any) -> Any:
        file, sep, attr = ref.rpartition(":") if isinstance(ref, str) else ("", "", "")
        if not sep or not file.endswith(".py") or Path(file).is_absolute():
            return ref
        return f"{(folder / file).resolve()}:{attr}"

    if "fn" in reward:
        reward["fn"] = anchored(reward["fn"])
    if isinstance(reward.get("by_source"), dict):
        reward["by_source"] = {source: anchored(ref) for source, ref in reward["by_source"].items()}


def parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. rollout.group_size=8")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(e["loc"])
            hint = suggest(field, e.get("input"), allowed)
            listed = f" (allowed: {', '.join(allowed)})" if allowed and not hint else ""
            lines.append(f"{field}: unknown key{hint}{listed}")
        else:
            lines.append(f"{field}: {e['msg']} (got {e.get('input')!r})")
    return "invalid config: " + "; ".join(lines)


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys the section holding ``loc`` allows (none known: empty)."""
    model: Any = SluiceConfig
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type):
            return []
        model = field.annotation
    return list(model.model_fields)

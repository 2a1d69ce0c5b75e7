"""Rewards given by import path (``reward.fn``, ``reward.by_source`` values): ``package.module:function``,
or by file, ``path/to/file.py:function`` (verl's habit; a relative path is relative to the config
file that names it, ``config/loading.py`` makes it absolute, or to the working directory).

``load_reward(path, field)`` imports the function where the run starts, so a typo is one
``ConfigError`` naming the config field, before any engine starts. ``ImportedReward(path)`` is
what the reward service ships to its worker processes: it pickles as the path alone and imports
the function again in each process (once, cached), so any importable function works in the
pool, whether or not the function itself pickles by reference.

Two calling conventions, chosen by the function's signature:

- sluice's ``fn(response, **fields)`` (``sluice.api.RewardFn``): the row's fields by name;
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``, recognised by a
  parameter named ``solution_str``: ``data_source`` is the row's source (``default`` when
  absent), ``ground_truth`` its ``answer``, ``extra_info`` its ``extra_info`` field if it has
  one, else its other fields as a dict. A dict result with a ``score`` key scores that key.

This module does not decide which reward a row gets (``composed.py``) nor time calls out
(``service.py``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sluice.config import ConfigError

DEFAULT_SOURCE = "default"
"""The ``data_source`` of a row that has none."""


@functools.cache
def load_reward(path: str, field: str = "reward.fn") -> Callable[..., Any]:
    """The callable at ``path`` (``package.module:attr``, ``attr`` may be dotted); a missing module
    or attribute, or one that is not callable, raises ``ConfigError`` naming ``field``."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{field}: {path!r} is not package.module:function nor path/to/file.py:function")
    target: Any = _module_of_file(module_name, field) if module_name.endswith(".py") else None
    try:
        target = target or importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"{field}: cannot import module {module_name!r} of {path!r} ({err}; looked on the Python path "
            f"from {os.getcwd()}): name the file instead, {field}=path/to/{module_name.rpartition('.')[2]}.py:{attr}, "
            "or add its folder to PYTHONPATH"
        ) from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{field}: {target.__name__!r} has no attribute {part!r} (from {path!r})")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{field}: {path!r} is a {type(target).__name__}, not a callable reward")
    return target


def _module_of_file(file: str, field: str) -> Any:
    """The module a ``.py`` file defines, imported once per process under a name of its own."""
    resolved = os.path.abspath(file)
    if not os.path.isfile(resolved):
        raise ConfigError(f"{field}: reward file {file!r} not found (looked at {resolved})")
    name = f"sluice_reward_{hashlib.sha1(resolved.encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    assert spec is not None and spec.loader is not None, resolved
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its functions pickle by reference in this process
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's file: one line naming it, not its traceback
        del sys.modules[name]
        raise ConfigError(f"{field}: reward file {file!r} failed to import: {type(err).__name__}: {err}") from None
    return module


def is_verl_style(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes verl's ``(data_source, solution_str, ground_truth, extra_info)``."""
    try:
        return "solution_str" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: sluice's convention
        return False


def call_verl_style(fn: Callable[..., Any], response: str, fields: Mapping[str, Any]) -> Any:
    """``fn`` called the way verl calls a ``compute_score``; a ``{"score": x, ...}`` result gives ``x``."""
    rest = {k: v for k, v in fields.items() if k not in ("answer", "data_source")}
    result = fn(
        data_source=fields.get("data_source", DEFAULT_SOURCE),
        solution_str=response,
        ground_truth=fields.get("answer"),
        extra_info=rest.pop("extra_info", rest),
    )
    if isinstance(result, Mapping) and "score" in result:
        return result["score"]
    return result


@dataclass(frozen=True)
class ImportedReward:
    """The reward at ``path``, called in either convention; pickles as ``path`` and ``field``."""

    path: str
    field: str = "reward.fn"

    @property
    def __name__(self) -> str:
        """The name failures are counted under: the function's own."""
        return self.path.rpartition(":")[2].rpartition(".")[2]

    def __call__(self, response: str, **fields: Any) -> Any:
        fn, verl = _resolved(self.path, self.field)
        if verl:
            return call_verl_style(fn, response, fields)
        return fn(response, **fields)


@functools.cache
def _resolved(path: str, field: str) -> tuple[Callable[..., Any], bool]:
    """The function and its convention, once per process."""
    fn = load_reward(path, field)
    return fn, is_verl_style(fn)

"""The judge side of ``code_exec``: runs the row's tests against a solution it cannot be fooled by.

Runs inside its own sandbox as ``code_judge.py <requests fd> <answers fd> <report fd>``, next to
the solution's sandbox (``code_server.py``), which it reaches only through two pipes. It reads
``plan.json`` (the tests, split into units by ``code_exec.py``), binds the solution's names to
``Remote`` proxies, runs each unit in order and writes ``pass <i>`` to the report pipe for every
test unit that finished without an exception. Only this process holds the report pipe.

Why the solution cannot fake a pass: its code never runs here. What comes back from it is plain
data rebuilt as genuine standard values (``code_wire.decode``), or a reference to one of its
objects; a reference never equals (or is ordered against) a value of the tests, so an object
whose ``__eq__`` always says yes is useless, and exit codes, ``SystemExit``, ``os._exit`` or
patched builtins over there only make the calls of the tests fail.

It does not decide the reward (``code_exec.py`` counts the passes against its own plan).
"""

from __future__ import annotations

import builtins
import importlib
import json
import sys
from typing import Any

import code_wire as wire

_channel: wire.Channel


class SolutionError(Exception):
    """The solution raised an exception that is not a built-in one, or it is gone."""


class Remote:
    """An object that lives in the solution's sandbox; every use is a request to it."""

    __slots__ = ("_id", "_type")

    def __init__(self, ref_id: int, type_name: str) -> None:
        object.__setattr__(self, "_id", ref_id)
        object.__setattr__(self, "_type", type_name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _ask("call", self, args, kwargs=kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _ask("getattr", self, (), name=name)

    def __setattr__(self, name: str, value: Any) -> None:
        _ask("setattr", self, (value,), name=name)

    def __len__(self) -> int:
        return _typed(_ask("len", self), int)

    def __bool__(self) -> bool:
        return _typed(_ask("bool", self), bool)

    def __str__(self) -> str:
        return _typed(_ask("str", self), str)

    def __repr__(self) -> str:
        return _typed(_ask("repr", self), str)

    def __contains__(self, item: Any) -> bool:
        return _typed(_ask("contains", self, (item,)), bool)

    def __iter__(self) -> Any:
        return _ask("iter", self)

    def __next__(self) -> Any:
        return _ask("next", self)

    def __getitem__(self, key: Any) -> Any:
        return _ask("getitem", self, (key,))

    def __setitem__(self, key: Any, value: Any) -> None:
        _ask("setitem", self, (key, value))

    def __delitem__(self, key: Any) -> None:
        _ask("delitem", self, (key,))

    def __neg__(self) -> Any:
        return _ask("neg", self)

    __hash__ = object.__hash__  # identity: a dict of references never asks the solution


def _forwarded(op: str, *, compare: bool) -> Any:
    def method(self: Remote, other: Any) -> Any:
        if compare and not isinstance(other, Remote):
            raise TypeError(f"an object of the solution ({self._type}) is never compared with a value of the tests")
        result = _ask(op, self, (other,))
        return _typed(result, bool) if compare else result

    method.__name__ = f"__{op}__"
    return method


for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(Remote, f"__{_op}__", _forwarded(_op, compare=True))
for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod"):
    setattr(Remote, f"__{_op}__", _forwarded(_op, compare=False))


def _typed(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"the solution answered {type(value).__name__} where {kind.__name__} is due")
    return value


def _outgoing(value: Any) -> Any:
    if isinstance(value, Remote):
        return {"t": "ref", "id": value._id}
    raise TypeError(f"a {type(value).__name__} of the tests cannot be passed to the solution")


def _incoming(ref: dict[str, Any]) -> Any:
    if ref["t"] == "module" and wire.is_stdlib_module(ref.get("v")):
        return importlib.import_module(ref["v"])  # this sandbox's own copy, not the solution's
    if ref["t"] == "ref" and type(ref.get("id")) is int:
        return Remote(ref["id"], str(ref.get("type", "object")))
    raise ValueError("malformed reference on the wire")


def _ask(op: str, target: Remote, args: tuple[Any, ...] = (), *, kwargs: dict[str, Any] | None = None, **extra: str):
    """Send one request about ``target``; its result, or the solution's exception raised here."""
    message = {"op": op, "ref": target._id, "args": [wire.encode(a, _outgoing) for a in args], **extra}
    if kwargs:
        message["kwargs"] = {str(k): wire.encode(v, _outgoing) for k, v in kwargs.items()}
    _channel.send(message)
    try:
        reply = _channel.receive()
    except EOFError as exc:
        raise SolutionError("the solution's process is gone") from exc
    if "raise" in reply:
        name, text = (str(x) for x in reply["raise"][:2])
        kind = getattr(builtins, name, None)
        if isinstance(kind, type) and issubclass(kind, Exception) and kind is not StopIteration:
            raise kind(text)
        raise SolutionError(f"{name}: {text}")
    if reply.get("stop") is True and op == "next":
        raise StopIteration
    for arg, after in zip(args, reply.get("mut") or [], strict=False):
        _copy_back(arg, wire.decode(after, _incoming) if after is not None else None)
    return wire.decode(reply["ok"], _incoming)


def _copy_back(arg: Any, after: Any) -> None:
    """The solution changed a list / dict / set / bytearray argument in place: so does this copy."""
    if type(arg) is not type(after):
        return
    if isinstance(arg, list | bytearray):
        arg[:] = after
    elif isinstance(arg, dict | set):
        arg.clear()
        arg.update(after)


def _namespace(hello: dict[str, Any]) -> dict[str, Any]:
    """The tests' globals: the solution's names that shadow neither builtins nor dunders."""
    namespace: dict[str, Any] = {"__name__": "__tests__", "__builtins__": builtins}
    names = hello.get("names")
    for name, data in (names if type(names) is dict else {}).items():
        if str.isidentifier(name) and not name.startswith("__") and not hasattr(builtins, name):
            try:
                namespace[name] = wire.decode(data, _incoming)
            except (ValueError, TypeError, KeyError, RecursionError):
                continue
    return namespace


def main() -> None:
    global _channel
    requests_fd, answers_fd, report_fd = (int(a) for a in sys.argv[1:4])
    report = open(report_fd, "w", buffering=1)  # noqa: SIM115 (lives with the process)
    with open("plan.json") as f:
        plan = json.load(f)
    _channel = wire.Channel(answers_fd, requests_fd)
    try:
        hello = _channel.receive()
    except (EOFError, ValueError):
        hello = {}
    if "error" in hello:
        print(f"the solution failed to load:\n{hello['error']}", file=sys.stderr)
    namespace = _namespace(hello)
    for index, unit in enumerate(plan):
        try:
            exec(compile(unit["source"], f"tests line {unit['line']}", "exec"), namespace)
        except BaseException as exc:  # deliberate: any exception, SystemExit included, fails the unit
            print(f"unit {index} (tests line {unit['line']}): {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        if unit["kind"] == "test":
            report.write(f"pass {index}\n")


if __name__ == "__main__":
    main()

"""The wire between a sandboxed solution and its judge: plain data as tagged JSON lines.

Runs inside both sandboxes (standard library only, no sluice import). ``encode`` turns plain
data into JSON-ready values, handing anything else to ``on_other`` (the solution side turns it
into a reference to an object it keeps); ``decode`` rebuilds values, always as genuine standard
types built here, never as the sender's objects, so a value from the solution cannot carry an
``__eq__`` of its own. References decode through ``on_ref``.

It does not run code, pickle, or trust the sender: a malformed message raises ``ValueError``.
"""

from __future__ import annotations

import collections
import decimal
import fractions
import json
import math
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

_SEQUENCES: dict[type, str] = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_SEQUENCES[collections.deque] = "deque"
_BUILD: dict[str, Callable[[list[Any]], Any]] = {
    "list": list,
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
    "deque": collections.deque,
}
_PAIRS: dict[type, str] = {dict: "dict", collections.OrderedDict: "odict", collections.Counter: "counter"}
_PAIRS[collections.defaultdict] = "dict"  # its factory stays behind: it compares as a dict
_BUILD_PAIRS = {"dict": dict, "odict": collections.OrderedDict, "counter": collections.Counter}


def encode(value: Any, on_other: Callable[[Any], Any]) -> Any:
    """``value`` as JSON-ready data (exact standard types only; others go to ``on_other``)."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"t": "float", "v": repr(value)}
    if kind in _SEQUENCES:
        return {"t": _SEQUENCES[kind], "v": [encode(item, on_other) for item in value]}
    if kind in _PAIRS:
        pairs = [[encode(k, on_other), encode(v, on_other)] for k, v in value.items()]
        return {"t": _PAIRS[kind], "v": pairs}
    if kind in (bytes, bytearray):
        return {"t": kind.__name__, "v": value.hex()}
    if kind is complex:
        return {"t": "complex", "v": [value.real, value.imag]}
    if kind is fractions.Fraction:
        return {"t": "fraction", "v": [value.numerator, value.denominator]}
    if kind is decimal.Decimal:
        return {"t": "decimal", "v": str(value)}
    if issubclass(kind, tuple) and hasattr(kind, "_fields") and kind.__bases__ == (tuple,):  # a namedtuple
        return {"t": "ntuple", "n": kind.__name__, "f": list(kind._fields), "v": [encode(i, on_other) for i in value]}
    return on_other(value)


def decode(data: Any, on_ref: Callable[[dict[str, Any]], Any]) -> Any:
    """Genuine standard values from ``encode``'s output; ``{"t": "ref", ...}`` goes to ``on_ref``."""
    if data is None or type(data) in (bool, int, str, float):
        return data
    if type(data) is not dict or type(data.get("t")) is not str:
        raise ValueError(f"malformed value on the wire: {type(data).__name__}")
    tag, body = data["t"], data.get("v")
    if tag in _BUILD:
        return _BUILD[tag](decode(item, on_ref) for item in _list(body))
    if tag in _BUILD_PAIRS:
        pairs = {decode(k, on_ref): decode(v, on_ref) for k, v in map(_pair, _list(body))}
        return _BUILD_PAIRS[tag](pairs)  # a Counter built from a dict takes it as counts
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag in ("bytes", "bytearray") and type(body) is str:
        return (bytes if tag == "bytes" else bytearray).fromhex(body)
    if tag == "complex":
        return complex(*(float(x) for x in _pair(body)))
    if tag == "fraction":
        return fractions.Fraction(*(int(x) for x in _pair(body)))
    if tag == "decimal" and type(body) is str:
        return decimal.Decimal(body)
    if tag == "ntuple":
        return _namedtuple(str(data.get("n")), tuple(map(str, _list(data.get("f")))))(
            *(decode(i, on_ref) for i in _list(body))
        )
    if tag in ("ref", "module"):
        return on_ref(data)
    raise ValueError(f"unknown tag on the wire: {tag!r}")


_NAMEDTUPLES: dict[tuple[str, tuple[str, ...]], type] = {}


def _namedtuple(name: str, fields: tuple[str, ...]) -> type:
    key = (name, fields)
    if key not in _NAMEDTUPLES:
        _NAMEDTUPLES[key] = collections.namedtuple(name, fields)  # validates both as identifiers
    return _NAMEDTUPLES[key]


def _list(body: Any) -> list[Any]:
    if type(body) is not list:
        raise ValueError("malformed value on the wire: expected a list")
    return body


def _pair(body: Any) -> list[Any]:
    if type(body) is not list or len(body) != 2:
        raise ValueError("malformed value on the wire: expected a pair")
    return body


class Channel:
    """One JSON object per line: ``send`` on one pipe, ``receive`` from another."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._reader: BinaryIO = open(read_fd, "rb", buffering=1 << 16)  # noqa: SIM115 (lives with the process)
        self._writer: BinaryIO = open(write_fd, "wb", buffering=1 << 16)  # noqa: SIM115

    def send(self, message: dict[str, Any]) -> None:
        self._writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        self._writer.flush()

    def receive(self) -> dict[str, Any]:
        """The next message; ``EOFError`` when the other side is gone."""
        line = self._reader.readline()
        if not line:
            raise EOFError("the other side of the channel is gone")
        message = json.loads(line)
        if type(message) is not dict:
            raise ValueError("malformed message on the wire")
        return message


def is_stdlib_module(name: str) -> bool:
    return type(name) is str and name.partition(".")[0] in sys.stdlib_module_names

"""JSON for the driver's checkpoint state: typed values that come back exactly, and nothing else.

A checkpoint's driver state (``controller/resume.py``) is dataclasses (the ledger and its
records, reports, prompts, the base evaluation), counters and dicts keyed by group id, tuples,
and the queue's rows, whose cells may be tensors. ``encode`` turns it into plain JSON, tagging
what JSON cannot say (``{"$tuple": [...]}``, ``{"$tensor": {...}}``, ...); ``decode`` rebuilds
exactly those types and, for dataclasses and enums, only the classes the caller allows by name.
Unlike a pickle, reading a file never runs code or builds an arbitrary object; an unknown tag or
class is an error naming it. pydantic's ``TypeAdapter`` was the first candidate, but it rebuilds
from annotations and the state holds ``Any`` fields (queue cells, prompt fields) whose tuples and
tensors it would return as lists.

Deliberately not here: files, checksums, which state a checkpoint holds.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
from collections import Counter
from typing import Any

import numpy as np
import torch


class StateCodecError(ValueError):
    """A value that cannot be written, or a document that cannot be read, as driver state."""


def dumps(value: Any, classes: dict[str, type]) -> str:
    return json.dumps(encode(value, classes), separators=(",", ":"))


def loads(text: str, classes: dict[str, type]) -> Any:
    return decode(json.loads(text), classes)


def encode(value: Any, classes: dict[str, type]) -> Any:
    """``value`` as JSON-ready data; dataclasses and enums only of ``classes``, which ``decode``
    will be given (raises ``StateCodecError`` naming a type it cannot hold, at the save rather
    than at the resume)."""
    if isinstance(value, enum.Enum):  # before str and int: a str or int enum stays an enum
        _allowed(classes, type(value).__name__, type(value))
        return {"$enum": [type(value).__name__, encode(value.value, classes)]}
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Tensor):
        return {"$tensor": _tensor(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        _allowed(classes, type(value).__name__, type(value))
        fields = {f.name: encode(getattr(value, f.name), classes) for f in dataclasses.fields(value)}
        return {"$dataclass": [type(value).__name__, fields]}
    if isinstance(value, Counter):
        return {"$counter": [[encode(k, classes), encode(v, classes)] for k, v in value.items()]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)).startswith("$")):
            return {k: encode(v, classes) for k, v in value.items()}
        return {"$dict": [[encode(k, classes), encode(v, classes)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, classes) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"$set": [encode(v, classes) for v in sorted(value, key=repr)]}
    if isinstance(value, list):
        return [encode(v, classes) for v in value]
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        raw = np.ascontiguousarray(value).tobytes()
        return {"$ndarray": {"dtype": value.dtype.str, "shape": list(value.shape), "b64": _b64(raw)}}
    raise StateCodecError(f"cannot store a {type(value).__module__}.{type(value).__qualname__} in driver state")


def decode(data: Any, classes: dict[str, type]) -> Any:
    """The value ``encode`` made ``data`` from; dataclasses and enums only from ``classes``."""
    if isinstance(data, list):
        return [decode(v, classes) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) != 1 or not next(iter(data)).startswith("$"):
        return {k: decode(v, classes) for k, v in data.items()}
    tag, body = next(iter(data.items()))
    if tag == "$tuple":
        return tuple(decode(v, classes) for v in body)
    if tag == "$set":
        return {decode(v, classes) for v in body}
    if tag == "$dict":
        return {decode(k, classes): decode(v, classes) for k, v in body}
    if tag == "$counter":
        return Counter({decode(k, classes): decode(v, classes) for k, v in body})
    if tag == "$tensor":
        return _from_tensor(body)
    if tag == "$ndarray":
        dtype = np.dtype(body["dtype"])
        if dtype.kind not in "biuf":
            raise StateCodecError(f"driver state holds an array of dtype {body['dtype']!r} (numbers only)")
        return np.frombuffer(base64.b64decode(body["b64"]), dtype=dtype).reshape(body["shape"]).copy()
    if tag == "$enum":
        return _allowed(classes, body[0], enum.Enum)(decode(body[1], classes))
    if tag == "$dataclass":
        return _dataclass(_allowed(classes, body[0], None), {k: decode(v, classes) for k, v in body[1].items()})
    raise StateCodecError(f"unknown tag {tag!r} in driver state")


def _allowed(classes: dict[str, type], name: str, base: type | None) -> Any:
    cls = classes.get(name)
    if cls is None or (base is not None and not issubclass(cls, base)):
        raise StateCodecError(f"driver state names class {name!r}, which a checkpoint may not hold")
    return cls


def _dataclass(cls: Any, values: dict[str, Any]) -> Any:
    """``cls`` with these field values (``init=False`` fields set after construction)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise StateCodecError(f"driver state gives {cls.__name__} unknown fields {unknown}")
    obj = cls(**{k: v for k, v in values.items() if fields[k].init})
    for name, value in values.items():
        if not fields[name].init:
            object.__setattr__(obj, name, value)  # frozen dataclasses too
    return obj


def _tensor(t: torch.Tensor) -> dict[str, Any]:
    flat = t.detach().cpu().contiguous()
    raw = flat.reshape(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    dtype = str(flat.dtype).removeprefix("torch.")
    return {"dtype": dtype, "shape": list(flat.shape), "b64": _b64(raw)}


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _from_tensor(body: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, body["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise StateCodecError(f"driver state holds a tensor of unknown dtype {body['dtype']!r}")
    raw = bytearray(base64.b64decode(body["b64"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
    return flat.reshape(body["shape"])

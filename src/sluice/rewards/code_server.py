"""The solution side of ``code_exec``: runs the response as module ``solution`` and serves calls.

Runs inside the solution's sandbox as ``code_server.py <requests fd> <answers fd>``. It executes
``/tmp/solution.py`` (the response's code), announces the module's names, then answers the
judge's requests (call, attribute, operator) with plain data, or with references to the objects
it keeps here.

Nothing here is trusted: the response runs in this process and may replace all of it. The judge
(``code_judge.py``, another sandbox) decides pass or fail from the values it receives, and this
process cannot reach the judge's report. It does not run tests.
"""

from __future__ import annotations

import builtins
import operator
import sys
import traceback
import types
from typing import Any

import code_wire as wire

OPERATORS = {
    "len": len,
    "iter": iter,
    "bool": bool,
    "str": str,
    "repr": repr,
    "contains": operator.contains,
    "getitem": operator.getitem,
    "setitem": operator.setitem,
    "delitem": operator.delitem,
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "neg": operator.neg,
}
MUTABLE = (list, dict, set, bytearray)


class Objects:
    """The objects handed to the judge by reference, by id."""

    def __init__(self) -> None:
        self.by_id: dict[int, Any] = {}

    def ref(self, value: Any) -> dict[str, Any]:
        if isinstance(value, types.ModuleType) and wire.is_stdlib_module(value.__name__):
            return {"t": "module", "v": value.__name__}
        self.by_id[id(value)] = value
        return {"t": "ref", "id": id(value), "type": type(value).__name__}

    def encode(self, value: Any) -> Any:
        return wire.encode(value, self.ref)

    def decode(self, data: Any) -> Any:
        return wire.decode(data, lambda ref: self.by_id[ref["id"]] if ref["t"] == "ref" else __import__(ref["v"]))


def answer(objects: Objects, request: dict[str, Any]) -> dict[str, Any]:
    """Carry out one request; the result (or the exception's name and message) to send back."""
    target = objects.by_id[request["ref"]]
    args = [objects.decode(a) for a in request.get("args", [])]
    op = request["op"]
    try:
        if op == "call":
            kwargs = {k: objects.decode(v) for k, v in request.get("kwargs", {}).items()}
            result = target(*args, **kwargs)
        elif op == "getattr":
            result = getattr(target, request["name"])
        elif op == "setattr":
            result = setattr(target, request["name"], args[0])
        elif op == "next":
            try:
                result = next(target)
            except StopIteration:
                return {"stop": True}
        else:
            result = OPERATORS[op](target, *args)
        mutated = [objects.encode(a) if isinstance(a, MUTABLE) else None for a in args]
        return {"ok": objects.encode(result), "mut": mutated}
    except Exception as exc:
        return {"raise": [type(exc).__name__, str(exc)[:1000]]}


def main() -> None:
    channel = wire.Channel(int(sys.argv[1]), int(sys.argv[2]))
    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    try:
        with open("/tmp/solution.py") as f:
            exec(compile(f.read(), "solution.py", "exec"), module.__dict__)
    except Exception:
        channel.send({"error": traceback.format_exc(limit=3)[-2000:]})
        return
    objects = Objects()
    names = {}
    for name, value in list(vars(module).items()):
        if not name.startswith("__") and not hasattr(builtins, name):
            try:
                names[name] = objects.encode(value)
            except Exception:  # deliberate: a value that will not encode is left out, not fatal
                continue
    channel.send({"names": names})
    while True:
        try:
            request = channel.receive()
        except EOFError:
            return
        channel.send(answer(objects, request))


if __name__ == "__main__":
    main()

"""Driver bytes, counted at the transport: everything the driver sends to or receives from Ray.

``DriverTransport`` is the only way the DAG runtime's driver talks to workers: ``call`` (a remote
method; arguments travel by value), ``get`` (results) and ``put``. Each payload is measured as
Ray would ship it — pickled with protocol 5, large buffers counted out of band without a copy —
and bytes belonging to sample data (a mapping whose keys are the DAG's columns, a ``Batch``, a
``PackedColumn``) are counted separately. A multi-controller run must show 0 sample bytes; the
single-controller variant, at least one batch per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.api import Batch


@dataclass
class DriverBytes:
    sent: int = 0
    received: int = 0
    sample: int = 0
    """Bytes of sample data among ``sent`` + ``received``."""
    calls: int = 0

    @property
    def total(self) -> int:
        return self.sent + self.received


@dataclass
class DriverTransport:
    columns: frozenset[str]
    """The DAG's column names: a mapping keyed by them is sample data."""
    counts: DriverBytes = field(default_factory=DriverBytes)

    def call(self, method: Any, *args: Any) -> Any:
        """``method.remote(*args)``, counting the arguments."""
        self.counts.calls += 1
        self.counts.sent += self._measure(args)
        return method.remote(*args)

    def get(self, refs: Any) -> Any:
        import ray

        value = ray.get(refs)
        self.counts.received += self._measure(value)
        return value

    def put(self, value: Any) -> Any:
        import ray

        self.counts.sent += self._measure(value)
        return ray.put(value)

    def _measure(self, value: Any) -> int:
        size = payload_bytes(value)
        self.counts.sample += sum(payload_bytes(part) for part in self._sample_parts(value))
        return size

    def _sample_parts(self, value: Any) -> Iterable[Any]:
        from sluice.queue.packed import PackedColumn

        if isinstance(value, (Batch, PackedColumn)):
            yield value
        elif isinstance(value, Mapping):
            if value and all(isinstance(k, str) and k in self.columns for k in value):
                yield value
            else:
                for v in value.values():
                    yield from self._sample_parts(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from self._sample_parts(v)


def payload_bytes(value: Any) -> int:
    """Bytes of ``value`` as Ray serialises it (pickle protocol 5, out-of-band buffers counted)."""
    import ray.cloudpickle as cloudpickle

    buffers: list[Any] = []
    head = cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return len(head) + sum(b.raw().nbytes for b in buffers)

"""The object store's registry actor: the newest ``keep`` weight versions' object refs, by version.

``ObjectStoreWeightSync`` (``object_store.py``) runs one per run as a Ray actor. It never
imports torch (it holds refs and puts the packed ``uint8`` numpy arrays it is given), so its
process starts without torch's ≈ 2 CPU-seconds of import; ``sluice.weights`` loads its backends
lazily for the same reason. Not here: packing tensors, fetching,
applying weights to an engine.
"""

from __future__ import annotations

import time
from typing import Any

from sluice.weights.versions import NO_VERSION, check_publish


class _Registry:
    """Actor state: the newest ``keep`` versions' object refs, each boxed in a list so Ray
    passes the ref itself rather than its value."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._refs: dict[int, list[Any]] = {}

    def store(self, version: int, packed: dict[str, Any]) -> None:
        """Put ``packed`` (this actor owns the object, so it outlives its publisher) as ``version``."""
        import ray

        check_publish(version, max(self._refs, default=NO_VERSION))
        self._refs[version] = [ray.put(packed)]
        for old in sorted(self._refs)[: -self.keep]:
            del self._refs[old]

    def lookup(self, version: int) -> list[Any] | None:
        return self._refs.get(version)

    def versions(self) -> list[int]:
        return sorted(self._refs)

    def heartbeat(self) -> float:
        return time.process_time()  # in the HEALTH group: answered beside a store

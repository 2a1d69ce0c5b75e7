"""Control calls between the DAG runtime's own actors: a worker to the admission gate, a worker
to rank 0 of its group.

A Ray actor call costs about a millisecond of CPU on each side here, and a multi-controller step
makes several of them per worker (a credit, a step report, metrics). When caller and callee share
a node, ``Peer`` makes the call over the callee's Unix socket instead (``sluice.queue.direct``: the
queue's same-node transport, a fraction of the cost); across nodes it goes through Ray. The callee
serves the methods it names in ``DIRECT_METHODS`` (``serve``) and says where in ``endpoint()``.
Only control messages travel this way (credits, step numbers, metric dicts), never sample data.
"""

from __future__ import annotations

from typing import Any


class Peer:
    """Blocking calls to one actor: direct on its node, through Ray otherwise (picklable)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._address: str | None = None  # resolved in the calling process, on first use

    def call(self, method: str, *args: Any) -> Any:
        from sluice.queue import direct

        address = self._resolve()
        if address:
            return direct.call(address, method, *args)
        import ray

        return ray.get(getattr(self.handle, method).remote(*args))

    def _resolve(self) -> str:
        if self._address is None:
            import ray

            from sluice.queue.direct import this_node

            node, address = ray.get(self.handle.endpoint.remote())
            self._address = address if node == this_node() else ""
        return self._address

    def __getstate__(self) -> dict[str, Any]:
        return {"handle": self.handle, "_address": None}  # another process resolves again


def endpoint_of(server: Any) -> tuple[str, str]:
    """``(node id, socket address)`` of a ``DirectServer`` running in this Ray actor."""
    import ray

    return str(ray.get_runtime_context().get_node_id()), server.address

"""The same rows to every rank of one data-parallel group: one rank fetches, the rest receive.

AsyncFlow §3.5: all ranks of a DP group (tensor / sequence parallel peers) need identical
micro-batches, so only one rank talks to the TransferQueue and the batch reaches the others by a
broadcast inside the group. ``DPGroupReader`` does that over any ``GroupBroadcast``:
``TorchGroupBroadcast`` (a ``torch.distributed`` process group: gloo on CPU, NCCL on GPU) for
ranks in different processes, ``ThreadGroupBroadcast`` for ranks that are threads of one process
(the in-process backend). Distinct DP groups of one task still get distinct rows: each group's
fetching rank is one consumer of the task's controller.

It deliberately does not pick which rows a group gets (the controller's policy or ``Shard``
does) and does not move tensors device-side (the trainer does after receiving).

A test helper, not product code: no ``sluice`` subcommand reads through a DP group yet (the
trainer's data-parallel ranks are DDP replicas that each read their own groups), so it lives
beside the tests that show the queue supports the pattern (``tests/unit/test_queue_lifecycle.py``,
``tests/integration/test_queue_ray.py``) until a runtime with tensor- or sequence-parallel peers
needs it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from sluice.api.queue import Batch, QueueClient

logger = logging.getLogger(__name__)


@runtime_checkable
class GroupBroadcast(Protocol):
    """The ranks of one data-parallel group (e.g. a ``torch.distributed`` group): one value, all ranks."""

    @property
    def rank(self) -> int:
        """This process's rank inside the group."""
        ...

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Every rank calls it; returns rank ``src``'s ``obj`` on every rank."""
        ...


class DPGroupReader:
    """``get`` for one rank of a DP group: rank ``src`` reads from the queue, every rank returns its batch."""

    def __init__(self, client: QueueClient | None, group: GroupBroadcast, src: int = 0) -> None:
        if group.rank == src and client is None:
            raise ValueError("the fetching rank needs a queue client")
        self.client = client
        self.group = group
        self.src = src

    def get(self, task: str, columns: Sequence[str], batch_size: int, **kwargs: Any) -> Batch:
        """Every rank of the group calls it with the same arguments (``QueueClient.get``'s)."""
        batch = None
        if self.group.rank == self.src:
            assert self.client is not None
            batch = self.client.get(task, columns, batch_size, **kwargs)
        return self.group.broadcast(batch, self.src)


class ThreadGroupBroadcast:
    """A ``GroupBroadcast`` whose ranks are threads of this process; ``group(n)`` makes all ``n`` ranks."""

    def __init__(self, rank: int, barrier: threading.Barrier, slot: list[Any]) -> None:
        self._rank = rank
        self._barrier = barrier
        self._slot = slot

    @staticmethod
    def group(size: int) -> list[ThreadGroupBroadcast]:
        barrier, slot = threading.Barrier(size), [None]
        return [ThreadGroupBroadcast(rank, barrier, slot) for rank in range(size)]

    @property
    def rank(self) -> int:
        return self._rank

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._rank == src:
            self._slot[0] = obj
        self._barrier.wait()  # the value is in the slot
        value = self._slot[0]
        self._barrier.wait()  # everyone has it: the slot may be reused
        return value


class TorchGroupBroadcast:
    """A ``GroupBroadcast`` over a ``torch.distributed`` group (the default group if ``None``)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._rank = dist.get_rank(group)

    @property
    def rank(self) -> int:
        return self._rank

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``src`` is the rank inside the group; the batch travels pickled (numpy buffers, no padding)."""
        root = src if self._group is None else self._dist.get_global_rank(self._group, src)
        box = [obj]
        self._dist.broadcast_object_list(box, src=root, group=self._group)
        return box[0]

"""TransferQueue: the streaming columnar sample store every pipeline task reads and writes.

Rows × columns in storage units, one controller per task (readiness, exactly-once consumption,
selection policies), an in-process backend (``LocalQueue``) and a Ray backend (``RayQueue``)
behind the contracts of ``sluice.api.queue``. Importing this package is cheap: the Ray backend
and the torch ``QueueIterableDataset`` load on first use.
"""

from typing import Any

from sluice.api.queue import AsyncQueueClient, Batch, Partition, QueueClient, RowMeta, Shard, StorageUnit
from sluice.queue.client import AsyncLocalQueue, LocalQueue
from sluice.queue.controller import TaskController
from sluice.queue.packed import PackedColumn
from sluice.queue.policies import POLICIES
from sluice.queue.storage import InMemoryStorageUnit

__all__ = [
    "POLICIES",
    "AsyncLocalQueue",
    "AsyncQueueClient",
    "AsyncRayQueue",
    "Batch",
    "InMemoryStorageUnit",
    "LocalQueue",
    "PackedColumn",
    "Partition",
    "QueueClient",
    "QueueIterableDataset",
    "RayQueue",
    "RowMeta",
    "Shard",
    "StorageUnit",
    "TaskController",
]


def __getattr__(name: str) -> Any:
    if name == "RayQueue":
        from sluice.queue.ray_backend import RayQueue

        return RayQueue
    if name == "AsyncRayQueue":
        from sluice.queue.ray_async import AsyncRayQueue

        return AsyncRayQueue
    if name == "QueueIterableDataset":
        from sluice.queue.dataset import QueueIterableDataset

        return QueueIterableDataset
    raise AttributeError(f"module 'sluice.queue' has no attribute {name!r}")

"""Weight sync backends: how a published policy version travels from the trainer to the engines.

Each backend implements ``sluice.api.WeightSync`` (``publish``, ``fetch``, ``latest_version``);
pick one by name from ``WEIGHT_SYNCS``. Applying weights to an engine (interrupt / defer /
staggered) is the engine's job, not this package's. Ray is imported only when an
``ObjectStoreWeightSync`` is used; ``BroadcastWeightSync`` needs only torch.distributed.
"""

from sluice.weights.broadcast import BroadcastWeightSync
from sluice.weights.local import NO_VERSION, InProcessWeightSync, WeightVersionError
from sluice.weights.object_store import ObjectStoreWeightSync

WEIGHT_SYNCS: dict[str, type] = {
    "local": InProcessWeightSync,
    "object_store": ObjectStoreWeightSync,
    "broadcast": BroadcastWeightSync,
}

__all__ = [
    "NO_VERSION",
    "WEIGHT_SYNCS",
    "BroadcastWeightSync",
    "InProcessWeightSync",
    "ObjectStoreWeightSync",
    "WeightVersionError",
]

"""Weight sync backends: how a published policy version travels from the trainer to the engines.

Each backend implements ``sluice.api.WeightSync`` (``publish``, ``fetch``, ``latest_version``);
pick one by name from ``WEIGHT_SYNCS``. Applying weights to an engine (interrupt / defer /
staggered) is the engine's job, not this package's. Ray is imported only when an
``ObjectStoreWeightSync`` is used; ``BroadcastWeightSync`` needs only torch.distributed. The
backends load on first use (as ``sluice.RLTrainer`` does): the object store's registry actor
imports ``sluice.weights.registry`` and must not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sluice.weights.versions import NO_VERSION, WeightVersionError

if TYPE_CHECKING:
    from sluice.weights.broadcast import BroadcastWeightSync
    from sluice.weights.local import InProcessWeightSync
    from sluice.weights.object_store import ObjectStoreWeightSync

_BACKENDS = {
    "InProcessWeightSync": ("sluice.weights.local", "local"),
    "ObjectStoreWeightSync": ("sluice.weights.object_store", "object_store"),
    "BroadcastWeightSync": ("sluice.weights.broadcast", "broadcast"),
}


def __getattr__(name: str) -> Any:
    if name == "WEIGHT_SYNCS":
        return {key: getattr(importlib.import_module(module), cls) for cls, (module, key) in _BACKENDS.items()}
    if name in _BACKENDS:
        return getattr(importlib.import_module(_BACKENDS[name][0]), name)
    raise AttributeError(f"module 'sluice.weights' has no attribute {name!r}")


__all__ = [
    "NO_VERSION",
    "WEIGHT_SYNCS",
    "BroadcastWeightSync",
    "InProcessWeightSync",
    "ObjectStoreWeightSync",
    "WeightVersionError",
]

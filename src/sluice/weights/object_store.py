"""Weight sync through the Ray object store: one ``ray.put`` per version, refs in a named actor.

``ObjectStoreWeightSync`` implements ``WeightSync`` across processes on one Ray cluster.
``publish`` packs the state dict as flat ``uint8`` numpy views (any dtype, bf16 included) and puts
it as ONE object (many small puts cost ~0.5 ms each) through a tiny named registry actor that
holds only the newest ``keep`` refs (dropping a ref frees the object once no fetcher still
uses it). Any process holding the (picklable) sync object can ``fetch``: it
asks the registry for the ref and ``ray.get`` s it, which maps the shared-memory buffers without
copying on the same node, so the returned tensors are read-only views that keep the object
pinned while they live (``update_weights`` copies them into the model or a host buffer).

The registry actor itself puts each version's object (a Ray object dies with the process that
put it; this costs one copy of the weights within the object store), so a replaced rollout
worker can fetch the current weights even after their publisher died. The registry actor
belongs to the process that created it (non-detached); if it dies, the run's weights are gone
and the run ends. It answers ``heartbeat`` in the ``HEALTH`` group (``api/health.py``), so a
stopped registry is named by the run's watchdog.

Not here: applying weights (``InferenceEngine.update_weights``), GPU collectives (NCCL
broadcast).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from sluice.api.health import HEALTH
from sluice.weights.registry import _Registry
from sluice.weights.versions import NO_VERSION, check_keep, missing_version

Packed = dict[str, tuple[np.ndarray, str, tuple[int, ...]]]  # name -> (uint8 bytes, dtype, shape)


def pack(named_tensors: Mapping[str, torch.Tensor]) -> Packed:
    """Each tensor as a flat ``uint8`` numpy view of its CPU bytes (copies only if not CPU-contiguous)."""
    packed: Packed = {}
    for name, t in named_tensors.items():
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        packed[name] = (flat.view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))
    return packed


def unpack(packed: Packed) -> dict[str, torch.Tensor]:
    """Tensors viewing the packed buffers (no copy; read-only when they come from the object store)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: _tensor(raw, getattr(torch, dtype), shape) for name, (raw, dtype, shape) in packed.items()}


def _tensor(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if raw.size == 0:  # an empty uint8 view cannot be reinterpreted (its stride is 0)
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


class ObjectStoreWeightSync:
    """``WeightSync`` over the Ray object store (see the module docstring).

    Construct it where Ray is initialised; it creates (or, with ``get_if_exists``, joins) the
    registry actor ``name`` in ``namespace``, whose ``keep`` wins when joining. Pickling keeps only
    the name, so the object can be passed to Ray tasks and actors of the same cluster.
    """

    def __init__(self, name: str = "sluice-weights", keep: int = 2, namespace: str | None = None) -> None:
        import ray

        self.name, self.keep, self.namespace = name, check_keep(keep), namespace
        registry = ray.remote(num_cpus=0, concurrency_groups={HEALTH: 1})(_Registry)
        self._registry: Any = registry.options(name=name, namespace=namespace, get_if_exists=True).remote(keep)

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "keep": self.keep, "namespace": self.namespace}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _registry=None)

    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """The whole state dict as one object, put by the registry as ``version`` (returns once stored)."""
        import ray

        ray.get(self._handle().store.remote(version, pack(named_tensors)))

    def fetch(self, version: int) -> Mapping[str, torch.Tensor]:
        """The tensors of ``version``: read-only, zero-copy views of the object on this node."""
        import ray

        boxed = ray.get(self._handle().lookup.remote(version))
        if boxed is None:
            raise missing_version(version, ray.get(self._handle().versions.remote()), self.keep)
        return unpack(ray.get(boxed[0]))

    def latest_version(self) -> int:
        import ray

        return max(ray.get(self._handle().versions.remote()), default=NO_VERSION)

    def shutdown(self) -> None:
        """Kill the registry actor (drops every held version); nothing to do if it is gone."""
        import ray

        with contextlib.suppress(ValueError):  # no actor of that name left (it died: the run's error says so)
            ray.kill(self._handle())
        self._registry = None

    def actor(self) -> Any:
        """The registry actor's handle (the run's watchdog pings its ``heartbeat``)."""
        return self._handle()

    def _handle(self) -> Any:
        if self._registry is None:
            import ray

            self._registry = ray.get_actor(self.name, namespace=self.namespace)
        return self._registry

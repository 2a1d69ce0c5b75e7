"""InProcessWeightSync: detached CPU copies, latest-``keep`` retention, clear errors; packing."""

from __future__ import annotations

import pytest
import torch

from sluice.api.protocols import WeightSync
from sluice.weights import (
    NO_VERSION,
    WEIGHT_SYNCS,
    BroadcastWeightSync,
    InProcessWeightSync,
    ObjectStoreWeightSync,
    WeightVersionError,
)
from sluice.weights.object_store import pack, unpack


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 3), value, requires_grad=True), "b": torch.arange(3.0) + value}


def test_registry_and_protocol() -> None:
    assert {
        "local": InProcessWeightSync,
        "object_store": ObjectStoreWeightSync,
        "broadcast": BroadcastWeightSync,
    } == WEIGHT_SYNCS
    assert isinstance(InProcessWeightSync(), WeightSync)


def test_publish_stores_detached_copies() -> None:
    sync = InProcessWeightSync()
    assert sync.latest_version() == NO_VERSION
    source = _tensors(1.0)
    sync.publish(source, version=0)
    with torch.no_grad():
        source["w"].add_(5.0)  # a later optimizer step must not change a published version
    got = sync.fetch(0)
    assert set(got) == {"w", "b"} and sync.latest_version() == 0
    assert torch.equal(got["w"], torch.ones(2, 3)) and not got["w"].requires_grad
    assert got["w"].device.type == "cpu"


def test_keeps_only_latest_versions_and_errors_clearly() -> None:
    sync = InProcessWeightSync(keep=2)
    for v in range(4):
        sync.publish(_tensors(float(v)), version=v)
    assert sync.latest_version() == 3
    assert torch.equal(sync.fetch(2)["b"], torch.arange(3.0) + 2)
    with pytest.raises(WeightVersionError, match=r"version 1 was dropped .*keep=2.*\[2, 3\]"):
        sync.fetch(1)
    with pytest.raises(WeightVersionError, match="version 7 was never published"):
        sync.fetch(7)
    with pytest.raises(ValueError, match="must not decrease"):
        sync.publish(_tensors(0.0), version=2)
    sync.publish(_tensors(9.0), version=3)  # the same version again replaces it
    assert torch.equal(sync.fetch(3)["w"], torch.full((2, 3), 9.0))
    with pytest.raises(ValueError, match="keep"):
        InProcessWeightSync(keep=0)


def test_pack_roundtrip_any_dtype() -> None:
    tensors = {
        "bf16": torch.randn(4, 5).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
        "ints": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "empty": torch.zeros(0, 4),
    }
    back = unpack(pack(tensors))
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_the_registry_actors_module_does_not_import_torch() -> None:
    """The object store's registry actor imports ``sluice.weights.registry`` (by reference, as Ray
    pickles the class): torch there costs every Ray run's start about 2 CPU-seconds."""
    import subprocess
    import sys

    from sluice.weights.object_store import _Registry

    heavy = "('torch', 'transformers')"
    probe = f"import sys, {_Registry.__module__}; print(sorted(m for m in {heavy} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"

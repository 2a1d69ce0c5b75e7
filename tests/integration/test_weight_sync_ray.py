"""ObjectStoreWeightSync on a real Ray cluster: an engine actor fetches, applies and tags tokens."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import ray
import torch

from sluice.api.protocols import WeightSync
from sluice.api.types import GenerationRequest, SamplingParams
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.weights import ObjectStoreWeightSync
from tiny import tiny_llama

pytestmark = pytest.mark.integration


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tiny_llama(seed).named_parameters()}


def _checksum(weights: dict[str, torch.Tensor]) -> float:
    return float(sum(t.double().sum() for t in weights.values()))


def test_engine_actor_applies_a_published_version(ray_cluster) -> None:
    sync = ObjectStoreWeightSync(name="test-weight-sync", keep=2)
    assert isinstance(sync, WeightSync) and sync.latest_version() == -1
    published = {v: _weights(v) for v in (1, 2, 3)}
    for version, weights in published.items():
        sync.publish(weights, version)
    assert pickle.loads(pickle.dumps(sync)).latest_version() == 3

    @ray.remote(num_cpus=0)
    class EngineActor:
        def __init__(self, model: torch.nn.Module, sync: ObjectStoreWeightSync) -> None:
            torch.set_num_threads(1)
            self.engine = HFInferenceEngine(model, max_batch=4, version=0)
            self.sync = sync

        def run(self, version: int, mode: str, steps_before: int) -> tuple[list, float, dict]:
            params = SamplingParams(max_new_tokens=8)
            first = self.engine.submit(GenerationRequest("a", (1, 2, 3), params, seed=1))
            for _ in range(steps_before):
                self.engine.step()
            self.engine.update_weights(self.sync.fetch(version), version, mode)  # type: ignore[arg-type]
            second = self.engine.submit(GenerationRequest("b", (4, 5), params, seed=2))
            while self.engine.has_work():
                self.engine.step()
            return [first.result(), second.result()], self.engine.weights_checksum(), self.engine.stats()

        def fetch_error(self, version: int) -> str:
            try:
                self.sync.fetch(version)
            except LookupError as err:
                return str(err)
            return ""

    actor = EngineActor.remote(tiny_llama(0), sync)
    assert "version 1 was dropped" in ray.get(actor.fetch_error.remote(1))  # keep=2 holds 2 and 3
    (first, second), checksum, stats = ray.get(actor.run.remote(3, "interrupt", 2))
    assert checksum == pytest.approx(_checksum(published[3]), rel=1e-12)
    assert first.versions == (0, 0, 0) + (3,) * 5 and second.versions == (3,) * 8
    assert stats["version"] == 3 and stats["weight_updates"] == 1
    sync.shutdown()


def test_a_version_outlives_its_publisher(ray_cluster) -> None:
    """The registry owns each version's object: a publisher that dies (a trainer replaced or
    killed) leaves the current weights fetchable for an engine restarted after it."""
    sync = ObjectStoreWeightSync(name="test-weight-owner", keep=2)

    @ray.remote(num_cpus=0)
    class Publisher:
        def pid(self) -> int:
            return os.getpid()

        def publish(self, sync: ObjectStoreWeightSync, weights: dict[str, torch.Tensor]) -> int:
            sync.publish(weights, 1)
            return 1

    publisher = Publisher.remote()
    weights = {**_weights(7), "big": torch.randn(1 << 20)}  # 4 MiB: kept in shared memory, not inlined in its ref
    assert ray.get(publisher.publish.remote(sync, weights)) == 1
    pid = ray.get(publisher.pid.remote())
    ray.kill(publisher)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}"), "the publisher's process outlived ray.kill"
    time.sleep(3)  # Ray's news of the owner's death (a publisher-owned object is lost by then)
    fetched = sync.fetch(1)
    assert _checksum(dict(fetched)) == _checksum(weights)
    sync.shutdown()

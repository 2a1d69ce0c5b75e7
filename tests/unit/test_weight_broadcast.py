"""BroadcastWeightSync: a trainer process and an engine process (spawned) hold identical weights
after each versioned broadcast; publishing never waits for the receiver."""

from __future__ import annotations

import io
import multiprocessing as mp
import os

import pytest
import torch

from sluice.api.protocols import WeightSync
from sluice.trainer.rendezvous import free_tcp_address
from sluice.weights import WEIGHT_SYNCS, BroadcastWeightSync, WeightVersionError
from sluice.weights.broadcast import EngineWorkersFeed, flatten, unflatten
from sluice.weights.wire import bucket_layout, bucket_ranges

BUCKET = 64


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(11, 4, generator=g)
    return {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied: one storage under two names
        "norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "layer.bias": torch.randn(3, 2, generator=g).t(),  # not contiguous
        "steps": torch.tensor([seed], dtype=torch.int64),
    }


def _receive(address: str, versions: list[int], keep: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    sync = BroadcastWeightSync(address, receivers=1, keep=keep, bucket_bytes=BUCKET).receiver(1)
    got: dict[int, object] = {}
    for version in versions:
        try:
            got[version] = {n: t.clone() for n, t in sync.fetch(version).items()}
        except WeightVersionError as exc:
            got[version] = f"WeightVersionError: {exc}"
    out = io.BytesIO()  # bytes, not tensors: shared-memory tensors die with this process
    torch.save((got, sync.latest_version()), out)
    results.put(out.getvalue())
    sync.close()
    results.close()
    results.join_thread()  # the bytes are in the pipe
    os._exit(0)  # not through gloo's destructors: they can abort at interpreter exit (1 run in ~30 here)


def test_flatten_round_trip_packs_tied_tensors_once() -> None:
    weights = _weights(3)
    layout, buffer = flatten(weights, torch.device("cpu"))
    unique = sum(t.numel() * t.element_size() for n, t in weights.items() if n != "lm_head.weight")
    assert buffer.numel() == unique
    back = unflatten(layout, buffer)
    for name, tensor in weights.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert back["embed.weight"].data_ptr() == back["lm_head.weight"].data_ptr()
    _, again = flatten(_weights(4), torch.device("cpu"), spare=buffer)
    assert again.data_ptr() == buffer.data_ptr()  # the spare buffer now holds the new weights
    assert torch.equal(unflatten(layout, again)["steps"], torch.tensor([4]))


def test_buckets_cut_between_tensors_and_keep_aliases_with_their_source() -> None:
    weights = _weights(3)  # embed 176 B (lm_head its alias), norm 8 B, bias 24 B, steps 8 B
    layout, buffer = flatten(weights, torch.device("cpu"))
    ranges = bucket_ranges(layout, BUCKET)
    assert ranges == [(0, 176), (176, 216)]  # the embedding alone fills one; the rest is the last
    assert [e[0] for e in bucket_layout(layout, ranges, 0)] == ["embed.weight", "lm_head.weight"]
    rebuilt: dict[str, torch.Tensor] = {}
    for index, (start, end) in enumerate(ranges):  # what a receiver that loads as it goes sees
        rebuilt |= unflatten(bucket_layout(layout, ranges, index), buffer[start:end].clone(), start)
    assert rebuilt.keys() == weights.keys()
    assert all(torch.equal(rebuilt[n], t) for n, t in weights.items())
    assert bucket_ranges(layout, 1) == [(0, 176), (176, 184), (184, 208), (208, 216)]  # one tensor each
    assert bucket_ranges(layout, 1 << 20) == [(0, 216)] and bucket_ranges([], 8) == [(0, 0)]


def test_two_processes_hold_identical_weights_after_each_broadcast() -> None:
    address = free_tcp_address()
    group = BroadcastWeightSync(address, receivers=1, backend="gloo", bucket_bytes=BUCKET)  # 3 buckets a version
    publisher = group.publisher()
    assert isinstance(publisher, WeightSync) and WEIGHT_SYNCS["broadcast"] is BroadcastWeightSync
    published = {v: _weights(v) for v in (1, 2, 3)}
    for version in (1, 2):  # returns before any receiver exists: the transfer is off the trainer's path
        publisher.publish(published[version], version)
    assert publisher.latest_version() == 2
    with pytest.raises(ValueError, match="must not decrease"):
        publisher.publish(published[1], 1)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_receive, args=(address, [2, 3, 1], 2, results))
    child.start()
    try:
        publisher.publish(published[3], 3)
        got, latest = torch.load(io.BytesIO(results.get(timeout=120)))
    finally:
        group.publisher().close()
        child.join(timeout=60)
    assert child.exitcode == 0 and latest == 3
    for version in (2, 3):
        received = got[version]
        assert isinstance(received, dict) and received.keys() == published[version].keys()
        for name, tensor in published[version].items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), (version, name)
    assert str(got[1]).startswith("WeightVersionError") and "dropped" in str(got[1])  # keep=2 held 2 and 3


def test_views_refuse_the_other_role() -> None:
    group = BroadcastWeightSync("tcp://127.0.0.1:1", receivers=2)
    with pytest.raises(RuntimeError, match="publisher"):
        group.receiver(1).publish({}, 1)
    with pytest.raises(RuntimeError, match="receiver"):
        group.publisher().fetch(1)
    with pytest.raises(ValueError, match="outside"):
        BroadcastWeightSync("tcp://127.0.0.1:1", receivers=2, rank=3)
    with pytest.raises(ValueError, match="backend"):
        BroadcastWeightSync("tcp://127.0.0.1:1", backend="mpi")  # type: ignore[arg-type]


def test_fleet_config_picks_the_transfer() -> None:
    from sluice.config import load_config
    from sluice.config.fleet import FleetConfig
    from sluice.runtime.pipelines import weight_syncs

    trainer, engines = weight_syncs(FleetConfig(weight_transfer="broadcast", broadcast_backend="gloo"), "unused")
    assert isinstance(trainer, BroadcastWeightSync) and isinstance(engines, BroadcastWeightSync)
    assert (trainer.rank, engines.rank) == (0, 1) and trainer.group == engines.group
    assert trainer.group.address.startswith("tcp://127.0.0.1:")  # no cluster: this node's loopback
    fleet = FleetConfig(weight_transfer="broadcast", broadcast_backend="gloo")
    on_trainer_node = weight_syncs(fleet, "unused", "tcp://10.0.0.2:29500")  # the Ray pipeline's choice
    assert {sync.group.address for sync in on_trainer_node} == {"tcp://10.0.0.2:29500"}  # type: ignore[attr-defined]
    assert load_config(None, ["fleet.weight_transfer=broadcast"]).fleet.weight_transfer == "broadcast"
    with pytest.raises(ValueError, match=r"run\.backend: ray"):
        load_config(None, ["fleet.weight_transfer=broadcast", "run.backend=local"])
    with pytest.raises(ValueError, match=r"resources\.rollout\.replica_actors needs"):
        load_config(None, ["resources.rollout.replica_actors=true", "run.backend=local"])
    assert load_config(None, ["fleet.lpt=true", "run.mode=sync"]).fleet.lpt  # sync runs the same LLMProxy
    trainer, feed = weight_syncs(fleet, "unused", engine_ranks=4, bucket_mb=2)  # vLLM's workers receive
    assert isinstance(trainer, BroadcastWeightSync) and isinstance(feed, EngineWorkersFeed)
    assert trainer.group.world_size == 5 and trainer.group.bucket_bytes == 2 << 20
    assert feed.worker_group(3).as_tuple() == (trainer.group.address, 5, "gloo", fleet.broadcast_timeout_s, 3)
    assert feed.fetch(1) == {}  # nothing passes through the rollout worker
    with pytest.raises(ValueError, match="outside"):
        feed.worker_group(5)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["rollout.weight_update=staggered"], r"rollout\.weight_update: staggered"),
        (["run.controller=multi"], r"run\.controller: multi"),
        (["vllm.weight_transfer=folder"], r"vllm\.weight_transfer: folder"),
    ],
)
def test_what_vllm_workers_on_the_group_cannot_run_is_refused_naming_it(overrides: list[str], field: str) -> None:
    from sluice.config import load_config

    base = ["rollout.engine=vllm", "fleet.weight_transfer=broadcast", "run.backend=ray"]
    with pytest.raises(ValueError, match=field):
        load_config(None, [*base, *overrides])
    assert load_config(None, [*base, "rollout.weight_update=defer"]).fleet.weight_transfer == "broadcast"
    assert load_config(None, [*base, "resources.rollout.replica_actors=true"]).resources.rollout.replica_actors
    for option, instead in (("rollout.dtype=bfloat16", "vllm.dtype"), ("rollout.session_cache_mib=8", "prefix")):
        with pytest.raises(ValueError, match=rf"{option.split('=')[0]} is the built-in engine's.*{instead}"):
            load_config(None, ["rollout.engine=vllm", option])

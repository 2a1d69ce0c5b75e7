"""The vLLM engine's pure parts, without vLLM: in-memory weight staging (``WeightTensors``), the
placement checks (``placement_args``) and the ``vllm.*`` config that feeds them. The engine
itself runs in ``tests/integration/test_vllm_engine.py`` (``make vllm-test``)."""

from __future__ import annotations

import functools
import inspect
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from sluice.config import load_config
from sluice.engines.hf_model import load_causal_lm
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.vllm_engine import VLLMEngine, placement_args, reload_from_shared
from sluice.engines.weight_folder import EMBED, HEAD, weights_checksum
from sluice.engines.weight_tensors import SharedWeights, WeightTensors
from tiny import save_tiny_task_model
from vllm_support import shm_files


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_task_model(tmp_path_factory.mktemp("vllm_weights_model"))


@pytest.fixture
def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return HFTrainEngine(load_causal_lm(model_dir), lr=1e-3).export_weights()


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def test_staged_tensors_are_snapshots_written_nowhere(model_dir: Path, weights, tmp_path: Path) -> None:
    stager = WeightTensors(model_dir, tmp_path)
    before, shm = _files(tmp_path), shm_files()
    items = dict(stager.write(weights, 1).items)
    assert _files(tmp_path) == before and not shm_files() - shm  # no file for an update
    assert weights[EMBED].data_ptr() == weights[HEAD].data_ptr() and set(items) == set(weights) - {HEAD}
    expected = {name: w.clone() for name, w in items.items()}
    staged_sum = stager.checksum(weights)
    with torch.no_grad():
        for w in weights.values():  # the trainer keeps training after handing the weights over
            w.add_(1.0)
    assert all(torch.equal(items[n], expected[n]) for n in items)
    assert stager.staged_checksum(1) == staged_sum != stager.checksum(weights)  # summed from the snapshot
    assert all(items[n].data_ptr() != weights[n].data_ptr() for n in items)


def test_untied_serving_sends_the_output_layer_as_its_own_tensor(model_dir: Path, weights, tmp_path: Path) -> None:
    stager = WeightTensors(model_dir, tmp_path, untie=True)
    serving = stager.serving_folder()  # the engine starts from an untied copy, written once
    assert serving.is_dir() and (serving / "model.safetensors").is_file()
    before = _files(tmp_path)
    items = dict(stager.write(weights, 1).items)
    assert _files(tmp_path) == before
    assert torch.equal(items[HEAD], weights[EMBED]) and items[HEAD].data_ptr() != items[EMBED].data_ptr()
    assert stager.checksum(items) == pytest.approx(weights_checksum(weights), rel=1e-12)  # lm_head once
    without_embed = {n: w for n, w in weights.items() if n not in (EMBED, HEAD)}
    with pytest.raises(ValueError, match="cannot untie"):
        stager.write(without_embed, 2)
    stager.close()
    assert not serving.exists()


def test_superseded_versions_are_released(model_dir: Path, weights, tmp_path: Path) -> None:
    stager = WeightTensors(model_dir, tmp_path)
    handles = [stager.write(weights, version).handle for version in (1, 2, 3)]
    stager.release_older(3)
    assert set(stager.staged) == {3}
    assert dict(handles[2].open()).keys() == dict(stager.staged[3].items).keys()
    with pytest.raises(RuntimeError, match="no longer refers to them"):  # closed: nothing stale is mapped
        handles[0].open()
    changed = {name: w + 1.0 for name, w in weights.items() if name != HEAD}  # the tied alias stays out
    assert stager.write(changed, 4).handle == handles[1]  # the last released block is refilled
    assert all(torch.equal(w, changed[n]) for n, w in handles[1].open())
    stager.close()
    assert stager.staged == {}
    for handle in handles[1:]:
        with pytest.raises(RuntimeError, match="no longer refers to them"):
            handle.open()


def _placement(**overrides: object) -> dict:
    args: dict = {"tensor_parallel_size": 1, "gpu_memory_utilization": None, "kv_cache_mb": 64, "on_cpu": True}
    return placement_args(**{**args, "gpus": 0, "numa_nodes": 1, **overrides})


def test_placement_sizes_the_kv_cache_by_megabytes_or_by_gpu_fraction() -> None:
    assert _placement() == {"tensor_parallel_size": 1, "kv_cache_memory_bytes": 64 << 20}
    gpu = _placement(on_cpu=False, gpus=8, tensor_parallel_size=8, gpu_memory_utilization=0.85)
    assert gpu == {"tensor_parallel_size": 8, "gpu_memory_utilization": 0.85}


def test_cpu_tensor_parallelism_takes_one_numa_node_per_rank_unless_bound_by_hand() -> None:
    assert _placement(tensor_parallel_size=2, numa_nodes=2)["tensor_parallel_size"] == 2
    assert _placement(tensor_parallel_size=2, threads_bind="0|1")["tensor_parallel_size"] == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tensor_parallel_size": 2}, r"vllm\.tensor_parallel_size=2: vLLM on CPU runs one rank per NUMA node .* 1"),
        ({"gpu_memory_utilization": 0.5}, r"vllm\.gpu_memory_utilization sizes GPU memory; .*vllm\.kv_cache_mb"),
        ({"on_cpu": False, "gpus": 2, "tensor_parallel_size": 4}, r"tensor_parallel_size=4 needs 4 GPUs; .* sees 2"),
    ],
)
def test_placement_this_worker_cannot_run_names_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _placement(**overrides)


def test_vllm_section_defaults_to_memory_and_reaches_the_engine() -> None:
    options = load_config(None, ["rollout.engine=vllm"]).engine_options()
    assert options["weight_transfer"] == "memory" and options["tensor_parallel_size"] == 1
    assert options["gpu_memory_utilization"] is None
    assert set(options) <= set(inspect.signature(VLLMEngine.__init__).parameters)  # every key is accepted
    custom = ["rollout.engine=vllm", "vllm.weight_transfer=folder", "vllm.tensor_parallel_size=4"]
    options = load_config(None, [*custom, "vllm.gpu_memory_utilization=0.9"]).engine_options()
    assert options["weight_transfer"] == "folder" and options["tensor_parallel_size"] == 4
    assert options["gpu_memory_utilization"] == 0.9


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("vllm.weight_transfer=disk", "weight_transfer"),
        ("vllm.tensor_parallel_size=0", "tensor_parallel_size"),
        ("vllm.gpu_memory_utilization=1.5", "gpu_memory_utilization"),
    ],
)
def test_bad_vllm_values_name_their_field(override: str, field: str) -> None:
    with pytest.raises((ValidationError, ValueError), match=field):
        load_config(None, [override])


class _RecordingWorker:
    """Stands in for a vLLM worker: keeps what ``reload_weights`` was given."""

    def reload_weights(self, *, weights_iterator) -> None:
        self.loaded = dict(weights_iterator)


def test_the_worker_maps_the_block_and_gets_every_tensor_exactly(weights) -> None:
    tensors = {
        **{name: w for name, w in weights.items() if name != HEAD},
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3).t(),  # not contiguous
        "empty": torch.empty(0, 4),
    }
    shared = SharedWeights(tensors)
    worker = _RecordingWorker()
    call = pickle.dumps(functools.partial(reload_from_shared, weights=shared.handle), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(call) < 4096  # the RPC carries the handle, never the tensors
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a read-only buffer would warn in torch.frombuffer
        pickle.loads(call)(worker)
    assert list(worker.loaded) == list(tensors)
    for name, t in tensors.items():
        got = worker.loaded[name]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    worker.loaded["bf16"].add_(1.0)  # the worker's mapping is copy-on-write: the sender's block stays
    assert torch.equal(dict(shared.items)["bf16"], tensors["bf16"])
    shared.close()

"""Engine choice (``rollout.engine``) and the tmpfs weight folders the out-of-process engines load."""

from __future__ import annotations

import gc
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sluice.config import load_config
from sluice.engines import build_inference_engine
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.weight_folder import EMBED, HEAD, WeightFolders, weights_checksum
from tiny import save_tiny_task_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_task_model(tmp_path_factory.mktemp("choice_model"))


def test_hf_is_the_default_and_unknown_names_fail(model_dir: Path) -> None:
    assert load_config(None, []).rollout.engine == "hf"
    engine = build_inference_engine("hf", model_dir, max_batch=3)
    assert isinstance(engine, HFInferenceEngine) and engine.max_batch == 3
    with pytest.raises(ValueError, match=r"rollout\.engine: unknown engine 'tgi'"):
        build_inference_engine("tgi", model_dir, max_batch=3)


def test_engine_options_come_from_their_section_in_either_mode(model_dir: Path) -> None:
    cfg = load_config(None, ["rollout.engine=vllm", "vllm.kv_cache_mb=64", "vllm.dtype=bfloat16"])
    assert cfg.engine_options()["kv_cache_mb"] == 64 and cfg.engine_options()["dtype"] == "bfloat16"
    assert load_config(None, []).engine_options() == {"dtype": "float32", "reprefill": True, "session_cache_mib": 256}
    stale = load_config(None, ["rollout.reprefill=false", "rollout.session_cache_mib=0"]).engine_options()
    built = build_inference_engine("hf", model_dir, max_batch=3, options=stale)
    assert built.reprefill is False and built.stats().get("session_kept") is None  # no session cache
    kept = load_config(None, ["rollout.session_cache_mib=8"]).engine_options()
    assert build_inference_engine("hf", model_dir, max_batch=3, options=kept).stats()["session_kept"] == 0
    with pytest.raises(ValueError, match=r"rollout\.reprefill: false needs rollout\.engine: hf"):
        load_config(None, ["rollout.engine=vllm", "rollout.reprefill=false"])
    bf16 = load_config(None, ["rollout.dtype=bfloat16"]).engine_options()
    engine = build_inference_engine("hf", model_dir, max_batch=3, options=bf16)
    assert next(engine.model.parameters()).dtype == torch.bfloat16  # rollout.dtype reaches the built-in engine
    sglang = load_config(None, ["rollout.engine=sglang", "sglang.url=http://10.0.0.2:30000"]).engine_options()
    assert sglang["url"] == "http://10.0.0.2:30000" and sglang["weights_dir"] == "/dev/shm"
    assert load_config(None, ["rollout.engine=vllm", "run.mode=sync"]).rollout.engine == "vllm"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_without_vllm_says_how_to_install(model_dir: Path) -> None:
    with pytest.raises(ImportError, match="make vllm-venv"):
        build_inference_engine("vllm", model_dir, max_batch=2)


def test_weight_folders_write_versions_and_drop_superseded(model_dir: Path, tmp_path: Path) -> None:
    weights = HFTrainEngine(load_causal_lm(model_dir), lr=1e-3).export_weights()
    assert weights[EMBED].data_ptr() == weights[HEAD].data_ptr()  # tied: export shares the tensor
    folders = WeightFolders(model_dir, tmp_path)
    assert folders.serving_folder() == model_dir  # nothing to untie unless asked
    one, two = folders.write(weights, 1), folders.write(weights, 2)
    saved = load_file(str(one / "model.safetensors"))
    assert HEAD not in saved and set(saved) == set(weights) - {HEAD}  # the alias is stored once
    assert all(torch.equal(saved[n], weights[n]) for n in saved)
    assert json.loads((one / "config.json").read_text()) == json.loads((model_dir / "config.json").read_text())
    folders.release_older(2)
    assert not one.exists() and two.exists()
    folders.close()
    assert not two.exists() and not folders.base.exists()
    dropped = WeightFolders(model_dir, tmp_path)
    base = dropped.base
    dropped.write(weights, 1)
    del dropped  # never closed: the folder still goes when the object does (tmpfs is RAM)
    gc.collect()
    assert not base.exists()


def test_untied_serving_copies_the_embedding_into_the_output_layer(model_dir: Path, tmp_path: Path) -> None:
    weights = HFTrainEngine(load_causal_lm(model_dir), lr=1e-3).export_weights()
    folders = WeightFolders(model_dir, tmp_path, untie=True)
    serving = folders.serving_folder()
    assert (serving / "tokenizer.json").is_file() and not json.loads((serving / "config.json").read_text())[
        "tie_word_embeddings"
    ]
    initial = load_file(str(serving / "model.safetensors"))
    assert torch.equal(initial[HEAD], initial[EMBED])
    untied = load_causal_lm(serving)  # an HF model loads the untied folder with the same outputs
    ids = torch.tensor([[1, 5, 6, 7]])
    assert torch.allclose(untied(ids).logits, load_causal_lm(model_dir)(ids).logits, atol=1e-6)
    saved = load_file(str(folders.write(weights, 1) / "model.safetensors"))
    assert torch.equal(saved[HEAD], weights[EMBED]) and saved[HEAD].data_ptr() != saved[EMBED].data_ptr()
    folders.close()


def test_checksum_counts_tied_weights_once_like_the_engine(model_dir: Path, tmp_path: Path) -> None:
    model = load_causal_lm(model_dir)
    weights = HFTrainEngine(model, lr=1e-3).export_weights()
    expected = HFInferenceEngine(model).weights_checksum()
    assert weights_checksum(weights) == pytest.approx(expected, rel=1e-12)  # shared alias: once
    copied = {name: w.clone() for name, w in weights.items()}  # as a weight sync delivers them
    assert WeightFolders(model_dir, tmp_path).checksum(copied) == pytest.approx(expected, rel=1e-12)
    assert weights_checksum(copied) != pytest.approx(expected, rel=1e-12)

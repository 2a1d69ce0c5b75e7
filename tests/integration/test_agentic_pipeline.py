"""Multi-turn agentic training end to end: the calculator task's episodes through the real
rollout worker (EnvRunner over LLMProxy), TransferQueue and trainer, on a random tiny model."""

from __future__ import annotations

import json

import pytest

from sluice import RLTrainer
from sluice.config import load_config
from sluice.tasks import TASKS
from sluice.tasks.spec import TinyLlamaSpec
from sluice.tasks.tiny_model import build_char_tokenizer, build_tiny_llama
from tiny import tiny_run_overrides


@pytest.fixture(scope="module")
def calculator_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("calculator_model")
    tok = build_char_tokenizer(TASKS["calculator"].alphabet)
    spec = TinyLlamaSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    build_tiny_llama(spec, tok, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize(("mode", "backend"), [("async", "local"), ("async", "ray"), ("sync", "local")])
def test_calculator_episodes_train_through_the_pipeline(calculator_model, tmp_path, mode, backend, request):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    options = [
        "task.name=calculator", f"run.mode={mode}", f"run.backend={backend}", "agentic.max_turns=3",
        "agentic.turn_tokens=6", "agentic.group_redundancy=1", "agentic.num_env_groups=5",
        "rollout.max_batch=16", "trainer.micro_batch_tokens=256",
    ]  # fmt: skip
    cfg = load_config(None, [*tiny_run_overrides(calculator_model, tmp_path, f"calc-{mode}-{backend}"), *options])
    result = RLTrainer(cfg).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    fates = next(r for r in records if r["kind"] == "fates")
    assert fates["groups_trained"] == 12
    weights = next(r for r in records if r["kind"] == "weights")
    assert weights["engine_version"] == weights["trainer_version"] == 3
    assert weights["engine_checksum"] == weights["trainer_checksum"]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 3 and all(r["response_len_mean"] > 0 for r in train)
    if mode == "sync":  # the barrier: every episode of a step ended before it trained
        assert all(r["trained_before_generated"] == 0.0 and r["staleness_max"] == 0 for r in train)
    episodes = next(r for r in records if r["kind"] == "episodes")
    assert episodes["env_episodes_kept"] >= 12 * 4  # 4 per group (group_size), redundant ones aside
    assert episodes["env_episodes_started"] >= 12 * 5
    assert len([r for r in records if r["kind"] == "eval"]) >= 2  # greedy held-out episodes, base and final

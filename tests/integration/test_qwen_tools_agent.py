"""``examples/qwen_tools_agent`` trains 2 steps: its unmodified OpenAI-tools agent, through the
endpoint, on a tiny gsm8k_style Qwen2 (BPE tokenizer trained here) with the Qwen-style template,
``tool_parser: hermes`` and ``math_verify`` scoring the agent's last reply (local backend)."""

from __future__ import annotations

import json

import pytest

from gsm8k_example import load, warm_start
from qwen_tools_example import EXAMPLE
from qwen_tools_example import load as example
from sluice import RLTrainer
from sluice.config import load_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Small gsm8k_style data, its model (a few SFT steps) and the example's copy of it."""
    root = tmp_path_factory.mktemp("qwen_tools")
    load("make_data").write_dataset(root / "data", train=200, test=50, seed=0)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 1, "max_position_embeddings": 256}  # fmt: skip
    base, _, _ = warm_start(root / "data", root / "base", small, steps_epochs=0.4)
    return root, example("make_model").build(base, root / "model", context=1024)


def test_the_example_trains_two_steps(built, tmp_path):
    root, model_dir = built
    overrides = [
        f"model.path={model_dir}", f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}", "eval.max_prompts=4", "rollout.group_size=2",
        "rollout.prompts_per_step=2", "rollout.max_new_tokens=12", "run.steps=2", "run.eval_every=2",
        "run.backend=local", "run.max_minutes=null", "run.threads=1", "run.progress=false",
        "tracking.samples_every=1", f"run.output_dir={tmp_path}",
    ]  # fmt: skip
    result = RLTrainer(load_config(EXAMPLE / "config.yaml", overrides)).fit()
    assert result.steps == 2
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert all(r["response_len_mean"] > 0 for r in records if r["kind"] == "train")
    episodes = [r for r in records if r["kind"] == "episodes"][-1]
    assert episodes["env_episodes_kept"] >= 2 * 2 * 2
    assert episodes["env_agent_calls"] >= episodes["env_episodes_kept"] and episodes["env_agent_mismatches"] == 0
    assert [r["count"] for r in records if r["kind"] == "eval"] == [4, 4]  # greedy agent episodes on val rows
    samples = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].startswith("<|im_start|>system\n# Tools\n") for s in samples)  # tools turn
    assert all('"name": "calculate"' in s["prompt"] and "<|im_start|>user\n" in s["prompt"] for s in samples)
    weights = next(r for r in records if r["kind"] == "weights")
    assert weights["engine_version"] == weights["trainer_version"] == 2

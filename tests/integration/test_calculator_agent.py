"""The calculator as an OpenAI-client agent (``examples/calculator_agent``) on the calculator's
SFT warm start: the agent's episodes are token for token the built-in ``Env``'s (same seeds,
same template, same tools), and ``sluice train`` with the example's config trains it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from sluice import RLTrainer
from sluice.api import PromptItem, SamplingParams
from sluice.config import load_config
from sluice.config.models import SluiceConfig
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_tokenizer
from sluice.rollout.agentic import build_env_runner, env_rollout_spec
from sluice.tasks import TASKS
from sluice.tasks.spec import eval_rows

EXAMPLE = Path(__file__).parents[2] / "examples" / "calculator_agent" / "config.yaml"


@pytest.fixture(scope="module")
def warm_start(calculator_warm_start) -> Path:
    """The calculator's SFT base model (``conftest.py``: built once, shared by sessions)."""
    return calculator_warm_start


def _runner(config: SluiceConfig, engine, model_dir: Path):
    spec = env_rollout_spec(config.agentic, "calculator", TASKS["calculator"].max_new_tokens)
    assert spec is not None
    tok = load_tokenizer(model_dir)
    params = SamplingParams(12, 1.0, 1.0, (tok.eos_token_id,))
    return build_env_runner(spec, engine, None, tok, params, group_size=4, run_seed=0, model_dir=model_dir)  # type: ignore[arg-type]


def test_the_agent_plays_the_envs_token_stream(warm_start):
    env_config = load_config(EXAMPLE, ["agentic.agent=null", "agentic.tool_parser=hermes"])
    agent_config = load_config(EXAMPLE, [])
    rows = [PromptItem(i, r["prompt"], (), {k: v for k, v in r.items() if k != "prompt"})
            for i, r in enumerate(eval_rows(TASKS["calculator"], 500)[:12])]  # fmt: skip
    engine = HFInferenceEngine.from_pretrained(warm_start, max_batch=16)

    async def play(runner):
        return await asyncio.gather(*(runner.episodes.run(item, item.index, k) for item in rows for k in range(2)))

    env_runner, agent_runner = _runner(env_config, engine, warm_start), _runner(agent_config, engine, warm_start)
    try:
        by_env, by_agent = asyncio.run(play(env_runner)), asyncio.run(play(agent_runner))
    finally:
        agent_runner.episodes.close()
    assert agent_runner.episodes.counts["mismatches"] == 0
    tools = 0
    for env_sample, agent_sample in zip(by_env, by_agent, strict=True):
        assert agent_sample.prompt_ids == env_sample.prompt_ids
        assert agent_sample.response_ids == env_sample.response_ids
        assert agent_sample.loss_mask == env_sample.loss_mask
        assert agent_sample.reward == env_sample.reward
        assert agent_sample.behav_logprobs == pytest.approx(env_sample.behav_logprobs, abs=1e-4)
        tools += env_sample.meta["turns"] > 1
    assert tools > 0 and agent_runner.episodes.counts["tool_calls"] >= tools  # the warm start calls the tool


# ``[ray]`` in the scale tier: ≈ 20 s of it is placing the run's actors (each rollout and trainer
# actor imports torch and transformers) before the first of two steps. ``make test`` keeps this
# agent's ``[local]`` run and an agentic run on Ray
# (``test_agentic_pipeline.py::test_calculator_episodes_train_through_the_pipeline[async-ray]``).
@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.scale)])
def test_sluice_train_trains_the_agent(warm_start, tmp_path, backend, request):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    overrides = [
        f"model.path={warm_start}", f"run.backend={backend}", "run.steps=2", "run.eval_every=2",
        "eval.max_prompts=16", "rollout.prompts_per_step=4", "rollout.group_size=4", "agentic.num_env_groups=5",
        "agentic.group_redundancy=1", "run.threads=1", "run.progress=false", f"run.output_dir={tmp_path}",
        f"run.name=agent-{backend}",
    ]  # fmt: skip
    result = RLTrainer(load_config(EXAMPLE, overrides)).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 2 and all(r["response_len_mean"] > 0 for r in train)
    episodes = next(r for r in records if r["kind"] == "episodes")
    assert episodes["env_episodes_kept"] >= 2 * 4 * 4
    assert episodes["env_agent_calls"] >= episodes["env_episodes_kept"] and episodes["env_agent_mismatches"] == 0
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) >= 2 and evals[0]["accuracy"] > 0  # greedy agent episodes on the warm start
    weights = next(r for r in records if r["kind"] == "weights")
    assert weights["engine_version"] == weights["trainer_version"] == 2

"""The evaluator's numbers, hand-computed: greedy accuracy, mean@k, pass@k, per source and bucket."""

import asyncio

import pytest

from fakes import DigitTokenizer, ScriptedEvalEngine, half_digit_reward
from sluice.api import PromptItem
from sluice.config.data import EvalConfig
from sluice.rollout.evaluate import evaluate_async

# prompt token -> (greedy answer, sampled answers...); answer d scores d / 2, correct iff d == 2
SCRIPT = {10: (2, 2, 0, 1), 11: (0, 0, 0, 0), 12: (1, 1, 2, 2), 13: (2, 0, 0, 0)}
SOURCES = {10: "math", 11: "math", 12: "code"}  # prompt 13 has no data_source: "default"


def _items(bucket: bool = False) -> list[PromptItem]:
    items = []
    for i, token in enumerate(SCRIPT):
        fields = {"data_source": SOURCES[token]} if token in SOURCES else {}
        if bucket:
            fields["bucket"] = "short" if i < 2 else "long"
        items.append(PromptItem(i, f"p{token}", (token, 1), fields))
    return items


def _evaluate(config: EvalConfig, items: list[PromptItem] | None = None, seed: int = 0):
    engine = ScriptedEvalEngine(SCRIPT)
    coro = evaluate_async(engine, items or _items(), DigitTokenizer(), half_digit_reward, 4, config, seed=seed)
    return asyncio.run(coro), engine


def test_sampled_evaluation_reports_mean_and_pass_at_k_per_source():
    result, engine = _evaluate(EvalConfig(samples=3, temperature=0.7))
    # greedy rewards 1, 0, 0.5, 1: two correct of four
    assert (result.count, result.samples) == (4, 3)
    assert result.accuracy == pytest.approx(0.5) and result.mean_reward == pytest.approx(0.625)
    # sampled rewards: (1, 0, .5) (0, 0, 0) (.5, 1, 1) (0, 0, 0): 4 of 12; prompts 10 and 12 pass
    assert result.mean_at_k == pytest.approx(4 / 12) and result.pass_at_k == pytest.approx(0.5)
    assert list(result.by_source) == ["code", "default", "math"]
    math, code, default = result.by_source["math"], result.by_source["code"], result.by_source["default"]
    assert (math.count, math.accuracy, math.mean_reward) == (2, 0.5, 0.5)
    assert math.mean_at_k == pytest.approx(1.5 / 6) and math.pass_at_k == pytest.approx(0.5)
    assert (code.accuracy, code.mean_reward, code.pass_at_k) == (0.0, 0.5, 1.0)
    assert code.mean_at_k == pytest.approx(2.5 / 3)
    assert (default.accuracy, default.mean_at_k, default.pass_at_k) == (1.0, 0.0, 0.0)
    assert result.by_bucket == {}  # the rows carry no bucket: no bucket breakdown
    hot = [r for r in engine.requests if r.params.temperature > 0]
    assert len(engine.requests) == 16 and {r.params.temperature for r in hot} == {0.7}
    assert len({r.seed for r in hot}) == 12  # every sample its own draw

    metrics = result.metrics()
    assert metrics["mean@k"] == pytest.approx(4 / 12) and metrics["pass@k"] == 0.5
    assert metrics["accuracy/math"] == 0.5 and metrics["pass@k/code"] == 1.0 and metrics["samples"] == 3
    assert not any(key.startswith("accuracy_") for key in metrics)


def test_greedy_only_evaluation_sends_one_request_per_prompt():
    result, engine = _evaluate(EvalConfig())
    assert len(engine.requests) == 4 and {r.params.temperature for r in engine.requests} == {0.0}
    assert result.samples == 0 and result.mean_at_k is None and result.pass_at_k is None
    assert result.by_source["math"].mean_at_k is None
    metrics = result.metrics()
    assert metrics["accuracy"] == 0.5 and metrics["accuracy/default"] == 1.0
    assert not any("@" in key for key in metrics)


def test_buckets_split_only_rows_that_carry_one_and_max_prompts_truncates():
    result, _ = _evaluate(EvalConfig(samples=3), _items(bucket=True))
    assert set(result.by_bucket) == {"long", "short"}
    assert result.by_bucket["short"].accuracy == 0.5 and result.by_bucket["long"].accuracy == 0.5
    assert result.by_bucket["long"].pass_at_k == 0.5  # prompt 12 passes, 13 does not
    assert result.metrics()["accuracy_short"] == 0.5

    capped, engine = _evaluate(EvalConfig(samples=3, max_prompts=2))
    assert capped.count == 2 and {r.prompt_ids[0] for r in engine.requests} == {10, 11}
    assert capped.accuracy == 0.5 and capped.pass_at_k == 0.5 and list(capped.by_source) == ["math"]


def test_sampled_draws_repeat_across_evaluations_and_follow_the_run_seed():
    def seeds(seed: int) -> list[int]:
        _, engine = _evaluate(EvalConfig(samples=2), seed=seed)
        return sorted(r.seed for r in engine.requests if r.params.temperature > 0)

    assert seeds(0) == seeds(0) != seeds(1)

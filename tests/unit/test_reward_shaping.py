"""Options that compose with any base reward: DAPO's overlong punishment (the formula's three
regimes, and the rollout adding it to a training sample's score), the format gate, and the
built-ins' coercion of numeric reference answers."""

import asyncio

import pytest

from fakes import FakeInferenceEngine, FaultyReward, length_reward
from sluice.api import PromptItem, RewardFailure, SamplingParams
from sluice.config import ConfigError, load_config
from sluice.rewards import (
    FormattedReward,
    OverlongPenalty,
    RewardService,
    build_reward_service,
    check_reward,
    exact_match_reward,
    math_verify_reward,
    overlong_penalty,
    overlong_shaping,
)
from sluice.rollout.single_turn import SingleTurnWorkflow


def _settle(service, cases):
    async def go():
        return await asyncio.gather(*(service(text, **fields) for text, fields in cases), return_exceptions=True)

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (12, 0.0),  # |y| <= L_max - L_cache = 20 - 8: nothing
        (13, (12 - 13) / 8 * 0.5),  # inside the buffer: ((L_max - L_cache) - |y|) / L_cache * factor
        (16, -0.25),
        (20, -0.5),  # |y| = L_max: -factor, continuous with the next regime
        (21, -0.5),  # beyond L_max: -factor
        (500, -0.5),
    ],
)
def test_overlong_penalty_is_dapo_eq_13(length, expected):
    """L_max = 20, L_cache = 8, factor 0.5."""
    assert overlong_penalty(length, max_len=20, buffer=8, factor=0.5) == expected
    assert OverlongPenalty(20, 8, 0.5)(length) == expected


def test_overlong_penalty_defaults_and_off():
    assert overlong_penalty(18, max_len=20, buffer=8) == -0.75  # factor 1.0
    assert overlong_penalty(10_000, max_len=20, buffer=0) == 0.0
    cfg = load_config(None, ["reward.overlong_buffer=8", "reward.overlong_penalty=0.5"]).reward
    assert overlong_shaping(cfg, 20) == OverlongPenalty(20, 8, 0.5)
    assert overlong_shaping(load_config(None, []).reward, 20) is None


@pytest.mark.parametrize("buffer", [20, 64])
def test_a_buffer_not_below_the_response_limit_is_a_config_error(buffer):
    cfg = load_config(None, [f"reward.overlong_buffer={buffer}"]).reward
    with pytest.raises(ConfigError, match=r"reward\.overlong_buffer: .* rollout\.max_new_tokens \(20\)"):
        check_reward(cfg, None, max_new_tokens=20)


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_the_rollout_adds_the_penalty_to_each_training_score():
    """Responses of 1..8 tokens (L_max 8, L_cache 4): the sample's reward is the base reward plus
    the penalty of its own length; a failed reward stays a failure."""
    params = SamplingParams(max_new_tokens=8)
    penalty = OverlongPenalty(8, 4, 1.0)
    workflow = SingleTurnWorkflow(_CharTokenizer(), params, group_size=16, length_penalty=penalty)
    failing = RewardService(FaultyReward("raise"), pool_size=0, name="faulty")

    async def go():
        engine = FakeInferenceEngine(vocab=1000)
        fine = await workflow.run(PromptItem(0, "p", (1, 2), {}), 0, engine, length_reward)
        failed = await workflow.run(PromptItem(1, "q", (1, 2), {"bucket": "long"}), 1, engine, failing)
        return fine, failed

    fine, failed = asyncio.run(go())
    lengths = {len(s.response_ids) for s in fine}
    assert min(lengths) <= 4 and max(lengths) > 5  # both regimes present
    for s in fine:
        text = _CharTokenizer().decode(s.response_ids)
        assert s.reward == length_reward(text) + overlong_penalty(len(s.response_ids), 8, 4)
    assert any(s.reward < length_reward(_CharTokenizer().decode(s.response_ids)) for s in fine)
    assert all(s.reward != s.reward and s.meta["reward_failure"] == "reward_error:faulty" for s in failed)


BOXED = r"(?s).*\\boxed\{.+\}.*"


def test_format_gate_composes_with_a_builtin_in_a_reward_process():
    """A response that does not match the pattern as a whole scores ``format_score``; one that
    does scores its base reward (here ``math_verify``, in a pool process)."""
    pytest.importorskip("math_verify")
    cfg = load_config(
        None,
        ["reward.name=math_verify", f"reward.format_pattern={BOXED}", "reward.format_score=-1", "reward.pool_size=1"],
    )
    service = build_reward_service(cfg.reward, default=None)
    try:
        scores = _settle(
            service,
            [
                ("so the answer is \\boxed{42}", {"answer": 42}),
                ("so the answer is \\boxed{41}", {"answer": 42}),
                ("so the answer is 42", {"answer": 42}),  # right, but not in the format
                ("\\boxed{}", {"answer": 42}),
            ],
        )
    finally:
        service.close()
    assert scores == [1.0, 0.0, -1.0, -1.0]
    assert service.fn == FormattedReward(service.fn.base, BOXED, -1.0) and service.__name__ == "math_verify"


def test_format_gate_skips_the_base_reward_and_wraps_by_source():
    calls = []

    def base(response, **fields):
        calls.append(response)
        return 1.0

    cfg = load_config(None, ["reward.format_pattern=<a>.*</a>", "reward.pool_size=0"]).reward
    service = build_reward_service(cfg, default=base)
    assert _settle(service, [("<a>x</a>", {}), ("x <a>x</a>", {})]) == [1.0, 0.0]  # fullmatch; default score 0
    assert calls == ["<a>x</a>"]
    routed = load_config(None, ["reward.format_pattern=<a>.*</a>", "reward.by_source.s=exact_match"]).reward
    fn = build_reward_service(routed.model_copy(update={"pool_size": 0}), default=None).fn
    assert fn("<a>1</a>", answer="<a>1</a>", data_source="s") == 1.0 and fn("1", answer="1", data_source="s") == 0.0


@pytest.mark.parametrize("reward", [exact_match_reward, math_verify_reward])
def test_numeric_answers_are_compared_as_text(reward):
    if reward is math_verify_reward:
        pytest.importorskip("math_verify")
    assert reward("42", answer=42) == 1.0
    assert reward(" 42 ", answer=42) == 1.0
    assert reward("43", answer=42) == 0.0
    assert reward("0.5", answer=0.5) == 1.0


@pytest.mark.parametrize(("answer", "kind"), [([42], "a list"), ({"x": 1}, "a dict"), (None, "missing")])
def test_non_scalar_answers_are_refused_naming_the_field(answer, kind):
    for reward in (exact_match_reward, math_verify_reward):
        with pytest.raises(TypeError, match=rf"reward field 'answer': the reference answer is {kind}"):
            reward("42", answer=answer)
    service = build_reward_service(load_config(None, ["reward.name=exact_match", "reward.pool_size=0"]).reward, None)
    (failure,) = _settle(service, [("42", {"answer": answer})])
    assert isinstance(failure, RewardFailure) and "reward field 'answer'" in str(failure)


def _rollout_worker(model_dir, *overrides, agentic=None):
    from sluice.rollout.worker import RolloutWorker

    cfg = load_config(None, ["reward.pool_size=0", *overrides])
    return RolloutWorker(
        model_dir, None, length_reward, SamplingParams(max_new_tokens=16), cfg.rollout, run_seed=0,
        reward_config=cfg.reward, fleet=cfg.fleet, engine_options=cfg.engine_options(), agentic=agentic,
    )  # fmt: skip


def test_the_rollout_worker_takes_l_max_from_its_sampling_limit(tiny_task_model):
    for overrides, expected in [
        (("reward.overlong_buffer=4", "reward.overlong_penalty=0.5"), OverlongPenalty(16, 4, 0.5)),
        ((), None),
    ]:
        worker = _rollout_worker(tiny_task_model, *overrides)
        try:
            assert worker.runner.workflow.length_penalty == expected
        finally:
            worker.close()
    with pytest.raises(ConfigError, match=r"reward\.overlong_buffer: 16 must be between 1 and .* \(16\)"):
        _rollout_worker(tiny_task_model, "reward.overlong_buffer=16")


def test_multi_turn_runs_refuse_the_overlong_penalty(tmp_path):
    from sluice.config.agentic import AgenticConfig
    from sluice.rollout.agentic import env_rollout_spec

    spec = env_rollout_spec(AgenticConfig(env="counter"), None, 16)
    with pytest.raises(ConfigError, match=r"reward\.overlong_buffer: single-turn rollouts only"):
        _rollout_worker(tmp_path / "never_loaded", "reward.overlong_buffer=4", agentic=spec)

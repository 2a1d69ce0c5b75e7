"""Built-in environments, the env registry (built-ins and import paths), the multi-turn tasks'
demonstrations, and the ``agentic`` config checks."""

from __future__ import annotations

import asyncio
import random

import pytest

from sluice.api import Env, ToolEnv
from sluice.config import ConfigError, load_config
from sluice.preflight import check_agentic
from sluice.rollout.envs import TINY_CHAT, CalculatorEnv, GuessNumberEnv, env_factory
from sluice.rollout.envs.calculator import calculate
from sluice.tasks import TASKS
from sluice.tasks.agentic import guess_episode
from sluice.tasks.tiny_model import build_char_tokenizer


def _play(env: Env, seed: int, actions: list[str], options=None) -> list:
    async def run():
        first = await env.reset(seed, options)
        return [first, *[await env.step(a) for a in actions]]

    return asyncio.run(run())


def test_calculator_rewards_only_the_right_product_and_answers_tool_calls():
    env = CalculatorEnv()
    first, tool, answer = _play(env, 0, ["c37*48", "a1776"], {"a": 37, "b": 48})
    assert first == "37*48" and isinstance(env, ToolEnv) and env.tools()[0]["name"] == "c"
    assert (tool.observation, tool.reward, tool.done) == ("1776", 0.0, False)
    assert (answer.reward, answer.done, answer.info["tool_calls"]) == (1.0, True, 1)
    _, wrong = _play(CalculatorEnv(), 0, ["a1777"], {"a": 37, "b": 48})
    assert (wrong.reward, wrong.done) == (0.0, True)
    assert calculate("12+30") == "42" and calculate("12-30") == "-18" and calculate("2**3") == "err"


def test_guess_number_hints_and_binary_search_always_wins_in_four():
    for seed in range(50):
        env = GuessNumberEnv()
        first = _play(env, seed, [])[0]
        lo, hi = map(int, first.split("-"))
        assert hi - lo == 14 and lo <= env.target <= hi
        for _ in range(4):
            guess = (lo + hi) // 2
            step = _play_step(env, f"g{guess}")
            if step.done:
                assert step.reward == 1.0
                break
            lo, hi = (guess + 1, hi) if step.observation == "h" else (lo, guess - 1)
        else:
            pytest.fail(f"binary search lost game {seed}")
    assert _play_step(GuessNumberEnv(), "guess").observation == "x"


def _play_step(env: GuessNumberEnv, action: str):
    return asyncio.run(env.step(action))


def test_env_factory_builds_built_ins_and_import_paths_with_kwargs():
    assert isinstance(env_factory("calculator")(), CalculatorEnv)
    made = env_factory("harness.sim_env:SimEnv", {"config": None, "instance": 7})()
    assert made.instance == 7
    with pytest.raises(ValueError, match="unknown env 'nope'"):
        env_factory("nope")
    with pytest.raises(ValueError, match="cannot load"):
        env_factory("harness.sim_env:Missing")


@pytest.mark.parametrize("name", ["calculator", "guess_number"])
def test_demonstrations_are_turns_of_the_tiny_chat_format_in_the_vocabulary(name):
    task = TASKS[name]
    tok = build_char_tokenizer(task.alphabet)
    rng = random.Random(0)
    for _ in range(200):
        row = task.make_row(rng)
        context, turn = task.demonstrate_turn(row, rng)
        ids = tok(context)["input_ids"] + tok(turn, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and context.endswith(">")
        assert len(ids) < task.model.max_position_embeddings
        assert context.count(TINY_CHAT.turn_end) == context.count("|")  # every model turn closed


def test_guess_demonstrations_win_at_a_warm_start_rate():
    rng = random.Random(1)
    task = TASKS["guess_number"]
    wins = sum(guess_episode(task.make_row(rng), rng)[-1][1] is None for _ in range(2000)) / 2000
    assert 0.2 < wins < 0.6


def test_agentic_config_runs_in_either_mode_and_needs_enough_env_groups():
    check_agentic(load_config(None, ["run.mode=async", "agentic.env=calculator"]), None)
    check_agentic(load_config(None, ["run.mode=sync"]), "calculator")
    with pytest.raises(ConfigError, match="num_env_groups"):
        check_agentic(load_config(None, ["run.mode=async", "agentic.num_env_groups=2"]), "calculator")

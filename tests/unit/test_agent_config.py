"""``agentic.agent`` at a run's start: one clear ``ConfigError`` naming the field for a path that
does not load, an agent beside an explicit env, or the barrier mode; a file path is resolved to
an absolute one (Ray workers' working directory may differ) and the built-in tasks get the tiny
chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.config import ConfigError, load_config
from sluice.preflight import check_agentic
from sluice.rollout.agentic import env_rollout_spec
from sluice.rollout.envs import TINY_CHAT_TEMPLATE

AGENT_FILE = Path(__file__).parents[2] / "examples" / "calculator_agent" / "agent.py"


def _spec(*overrides: str, task_env: str | None = "calculator"):
    config = load_config(None, ["task.name=calculator", *overrides])
    check_agentic(config, task_env)
    return env_rollout_spec(config.agentic, task_env, 12)


def test_agent_spec_by_module_or_file(monkeypatch):
    spec = _spec("agentic.agent=fakes:calculator_agent", "agentic.tool_parser=calculator")
    assert spec is not None and spec.agent == "fakes:calculator_agent" and spec.tool_parser == "calculator"
    assert spec.chat_template == TINY_CHAT_TEMPLATE  # the built-in task's tokenizer has none saved
    monkeypatch.chdir(AGENT_FILE.parents[2])
    relative = _spec("agentic.agent=examples/calculator_agent/agent.py:run")
    assert relative is not None and relative.agent == f"{AGENT_FILE}:run"
    single_turn = _spec("agentic.agent=fakes:calculator_agent", task_env=None)
    assert single_turn is not None and single_turn.chat_template is None  # the tokenizer's own, then
    assert _spec(task_env=None) is None  # no env, no agent: single-turn


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["agentic.agent=fakes:no_such_agent"], r"agentic.agent: cannot load 'fakes:no_such_agent'"),
        (["agentic.agent=no_such_module:run"], r"agentic.agent: cannot load 'no_such_module:run'"),
        (["agentic.agent=missing/agent.py:run"], r"agentic.agent: cannot load"),
        (["agentic.agent=run"], r"agentic.agent: 'run' is not 'package.module:function'"),
        (["agentic.agent=fakes:CALCULATOR_TOOL"], r"agentic.agent: 'fakes:CALCULATOR_TOOL' is a dict"),
        (["agentic.agent=fakes:calculator_agent", "agentic.env=calculator"], r"exclude each other"),
        (["agentic.agent=fakes:calculator_agent", "agentic.mode=barrier"], r"agentic.mode: 'barrier'"),
    ],
)
def test_bad_agent_settings_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _spec(*overrides)

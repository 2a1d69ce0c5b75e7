"""Failure budgets end to end: a run whose reward always fails stops within 60 s with one line
naming it (sync and async, local and Ray, raised and NaN), and ``sluice train`` prints that line
and exits 1; a reward failing on 10 % of prompts only costs their groups, counted in the fates."""

import json
import time

import pytest

from fakes import FaultyReward, FlakyReward
from sluice import RLTrainer
from sluice.cli import main
from sluice.config import load_config
from sluice.schedule.failures import FailureBudgetExceeded
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration

ERRORS = {"raise": "ValueError: scripted reward failure", "nan": "returned nan, not a finite number or a bool"}


def _overrides(model, tmp_path, name, mode, backend):
    run = [f"run.mode={mode}", f"run.backend={backend}", "run.eval_every=0", "rollout.max_new_tokens=8"]
    return [*tiny_run_overrides(model, tmp_path, name), *run]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("mode", "backend", "failure"),
    [("sync", "local", "raise"), ("async", "local", "nan"), ("async", "ray", "raise")],
)
def test_a_reward_that_always_fails_stops_the_run(request, tiny_task_model, tmp_path, mode, backend, failure):
    # the local cases keep the default budget: more than 50 % of a 64-group window, i.e. the 33rd
    # failed group; the Ray case checks the same rule over an 8-group window (the 5th failed
    # group), so its rollout actor generates 5 groups instead of 33
    window, trips = ([], 33)
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
        window, trips = (["run.failure_window=8"], 5)
    overrides = _overrides(tiny_task_model, tmp_path, f"always_{mode}_{backend}", mode, backend)
    trainer = RLTrainer(load_config(None, [*overrides, *window]), reward=FaultyReward(failure, always=True))
    started = time.monotonic()
    with pytest.raises(FailureBudgetExceeded) as stop:
        trainer.fit()
    assert time.monotonic() - started < 60
    assert str(stop.value) == (
        f"reward 'FaultyReward' failed {trips} of the last {trips} groups (budget 50 %); last error: {ERRORS[failure]}"
    )
    fates = next(r for r in _records(trainer.run_dir) if r["kind"] == "fates")
    kind = "error" if failure == "raise" else "invalid"
    assert fates[f"discarded_reward_{kind}:FaultyReward"] >= trips * 4
    assert fates["stopped"] == str(stop.value)
    assert "groups_trained" not in fates  # no step ever got a group


def test_sluice_train_prints_the_stop_as_one_line_and_exits_1(tiny_task_model, tmp_path, capsys):
    args = _overrides(tiny_task_model, tmp_path, "always_cli", "sync", "local")
    rc = main(["train", *args, "reward.fn=fakes:raising_reward", "run.failure_window=8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[-1] == (
        "error: reward 'raising_reward' failed 5 of the last 5 groups (budget 50 %); "
        "last error: ValueError: scripted reward failure"
    )
    assert not any(line.startswith("Traceback") for line in err)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_reward_failing_on_a_tenth_of_prompts_finishes_with_the_failures_counted(tiny_task_model, tmp_path, mode):
    overrides = [*_overrides(tiny_task_model, tmp_path, f"flaky_{mode}", mode, "local"), "run.steps=6"]
    result = RLTrainer(load_config(None, [*overrides, "run.failure_window=16"]), reward=FlakyReward(0.1)).fit()
    records = _records(result.run_dir)
    fates = next(r for r in records if r["kind"] == "fates")
    rewards = next(r for r in records if r["kind"] == "rewards")
    assert result.steps == 6
    failed = fates["discarded_reward_error:FlakyReward"]
    assert failed > 0 and failed % 4 == 0  # whole groups of 4
    assert rewards["reward_error:FlakyReward"] == failed  # every sample of a failing prompt failed
    assert failed / 4 <= 0.3 * (fates["groups_trained"] + failed / 4)  # about a tenth of the groups


def test_the_loop_by_hand_stops_on_the_same_budget(tiny_task_model, tmp_path):
    overrides = [*_overrides(tiny_task_model, tmp_path, "always_by_hand", "sync", "local"), "run.failure_window=8"]
    trainer = RLTrainer(load_config(None, overrides), reward=FaultyReward("raise", always=True))
    trainer.init_engines()
    trainer.load_prompt_data()
    try:
        assert trainer.send_experience_data() == []  # 4 failed groups of 8: within the 50 % budget
        with pytest.raises(FailureBudgetExceeded, match=r"^reward 'FaultyReward' failed 5 of the last 5 groups"):
            trainer.send_experience_data()
    finally:
        trainer.close()


def test_an_environment_that_always_fails_stops_the_run_with_one_line(tmp_path):
    from sluice.tasks import TASKS
    from sluice.tasks.spec import TinyLlamaSpec
    from sluice.tasks.tiny_model import build_char_tokenizer, build_tiny_llama

    model = tmp_path / "calculator_model"
    tok = build_char_tokenizer(TASKS["calculator"].alphabet)
    spec = TinyLlamaSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    build_tiny_llama(spec, tok, seed=0).save_pretrained(model)
    tok.save_pretrained(model)
    options = [
        "task.name=calculator", "run.mode=async", "run.backend=local", "run.eval_every=0", "agentic.max_turns=3",
        "agentic.turn_tokens=6", "agentic.env=fakes:FakeEnv", "agentic.env_kwargs={fail: [0, raise]}",
        "run.failure_window=16",
    ]  # fmt: skip
    config = load_config(None, [*tiny_run_overrides(model, tmp_path, "env_always"), *options])
    with pytest.raises(FailureBudgetExceeded) as stop:
        RLTrainer(config).fit()
    assert str(stop.value) == (
        "environment 'fakes:FakeEnv' failed 9 of the last 9 groups (budget 50 %); "
        "last error: env_error: step: RuntimeError('scripted env failure at step 0')"
    )

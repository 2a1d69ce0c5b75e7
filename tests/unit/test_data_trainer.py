"""RLTrainer's data checks at start, on a real tiny model folder (max_position_embeddings 64)."""

import json

import pytest

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import ConfigError, load_config
from sluice.data import DatasetError


def _trainer(model_dir, rows_path, *overrides, reward=length_reward):
    cfg = load_config(None, [f"model.path={model_dir}", f"data.train_files={rows_path}", "run.threads=1", *overrides])
    trainer = RLTrainer(cfg, reward=reward)
    trainer.init_engines()
    trainer.load_prompt_data()
    return trainer


@pytest.fixture
def rows_path(tmp_path):
    rows = [{"prompt": "12>", "answer": 21}, {"prompt": "9" * 40 + ">", "answer": "1"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_prompt_over_the_model_context_is_filtered_or_named(tiny_task_model, rows_path):
    trainer = _trainer(tiny_task_model, rows_path, "rollout.max_new_tokens=30")  # 42 tokens > 64 - 30
    assert [it.prompt for it in trainer.prompts.items] == ["12>"]
    assert trainer.filtered["train"]["too_long"] == 1
    assert trainer.prompts.items[0].fields["answer"] == "21"
    assert trainer.eval_items == []  # user data without data.val_files: no evaluation set
    limit = r"over the prompt limit \(34 tokens, the model's max_position_embeddings \(64\) - "
    limit += r"rollout.max_new_tokens \(30\)\)"  # where the 34 came from
    with pytest.raises(DatasetError, match=r"rows.jsonl line 2: the prompt is 42 tokens, " + limit):
        _trainer(tiny_task_model, rows_path, "rollout.max_new_tokens=30", "data.long_prompts=error")


def test_limits_beyond_the_model_context_and_missing_choices_are_config_errors(tiny_task_model, rows_path):
    with pytest.raises(
        ConfigError, match=r"rollout.max_new_tokens \(64\) must fit the model's max_position_embeddings"
    ):
        _trainer(tiny_task_model, rows_path, "rollout.max_new_tokens=64")
    with pytest.raises(ConfigError, match=r"data.max_prompt_length \(40\) \+ rollout.max_new_tokens \(30\)"):
        _trainer(tiny_task_model, rows_path, "rollout.max_new_tokens=30", "data.max_prompt_length=40")
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens: must be set with data.train_files"):
        _trainer(tiny_task_model, rows_path)
    with pytest.raises(ConfigError, match=r"reward: data.train_files needs a reward"):
        _trainer(tiny_task_model, rows_path, "rollout.max_new_tokens=8", reward=None)


def test_the_builtin_held_out_set_still_refuses_leaked_prompts(tiny_task_model):
    from sluice.tasks import TASKS
    from sluice.tasks.spec import eval_rows

    cfg = load_config(None, [f"model.path={tiny_task_model}", "task.eval_prompts=4", "run.threads=1"])
    trainer = RLTrainer(cfg, reward=length_reward)
    trainer.init_engines()
    leaked = eval_rows(TASKS["reverse_digits"], 4)[2]
    with pytest.raises(DatasetError, match=r"row 2: prompt is in the held-out set \(1 such rows\)"):
        trainer.load_prompt_data([{"prompt": "12>", "answer": "21"}, leaked])
    trainer.load_prompt_data([{"prompt": "12>", "answer": "21"}])
    assert len(trainer.eval_items) == 4 and {it.fields["data_source"] for it in trainer.eval_items} == {"default"}


def test_run_epochs_becomes_run_steps_over_the_prompts_read(tiny_task_model, tmp_path):
    """``run.epochs`` instead of ``run.steps``: 10 prompts, 4 per step, 1.5 passes → ceil(3.75) = 4."""
    path = tmp_path / "ten.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}>", "answer": str(i)}) + "\n" for i in range(10)))
    trainer = _trainer(
        tiny_task_model, path, "run.epochs=1.5", "rollout.prompts_per_step=4", "rollout.max_new_tokens=8"
    )
    assert (trainer.config.run.steps, trainer.config.run.epochs) == (4, None)

import pytest

from sluice import RLTrainer
from sluice.config import ConfigError, load_config


def test_unknown_task_names_the_field():
    with pytest.raises(ConfigError, match=r"task.name: unknown task 'nope'"):
        RLTrainer(load_config(None, ["task.name=nope"]))


def test_verbs_in_the_wrong_order_say_which_first():
    trainer = RLTrainer(load_config(None, ["run.mode=sync"]))
    with pytest.raises(RuntimeError, match=r"init_engines\(\) first"):
        trainer.load_prompt_data()


def test_the_verbs_need_data_first_and_close_is_safe_without_workers():
    trainer = RLTrainer(load_config(None, ["run.mode=sync"]))
    with pytest.raises(RuntimeError, match=r"load_prompt_data\(\) first"):
        trainer.send_experience_data()
    trainer.close()  # no workers were started: nothing to stop

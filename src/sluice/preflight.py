"""The checks of a run's config that need neither torch nor the model: a built-in task's name,
the agentic section against the task, and the user's data files against the response cap and
the reward.

``sluice train`` / ``sluice eval`` run them before importing torch and transformers (seconds), so
a wrong key costs a user a blink; ``RLTrainer`` runs them too, for runs started from Python. The
checks that need the tokenizer or the reward's module (rows, reward functions) stay with the run.
"""

from __future__ import annotations

from sluice.config import ConfigError, SluiceConfig
from sluice.config.agentic import check_agentic
from sluice.data import check_user_data
from sluice.tasks import TASKS
from sluice.tasks.spec import TaskSpec


def preflight(config: SluiceConfig, reward_given: bool) -> TaskSpec:
    """The run's built-in task, once its config passed the torch-free checks (``ConfigError``)."""
    task = TASKS.get(config.task.name)
    if task is None:
        raise ConfigError(f"task.name: unknown task {config.task.name!r} (built-in: {', '.join(TASKS)})")
    check_agentic(config, task.env)
    check_user_data(config, reward_given=reward_given)
    return task

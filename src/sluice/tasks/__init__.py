"""Built-in tasks and the embedded default's base-model builder. New tasks: one file + one entry."""

from sluice.tasks.reverse_digits import REVERSE_DIGITS
from sluice.tasks.spec import TaskSpec

TASKS: dict[str, TaskSpec] = {REVERSE_DIGITS.name: REVERSE_DIGITS}

__all__ = ["TASKS", "TaskSpec"]

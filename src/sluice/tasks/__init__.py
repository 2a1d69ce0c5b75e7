"""Built-in tasks and the embedded default's base-model builder. New tasks: one file + one entry."""

from sluice.tasks.agentic import CALCULATOR, GUESS_NUMBER
from sluice.tasks.reverse_digits import REVERSE_DIGITS
from sluice.tasks.spec import TaskSpec

TASKS: dict[str, TaskSpec] = {task.name: task for task in (REVERSE_DIGITS, CALCULATOR, GUESS_NUMBER)}

__all__ = ["TASKS", "TaskSpec"]

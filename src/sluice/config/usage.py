"""Which of a resolved config's sections a run reads, for ``sluice train --dry-run``.

A section is left out when the run cannot read it: the built-in task's when your data and model
replace it, an engine's options when another engine generates, the agentic section of a
single-turn run, the fleet's dispatch options when they are all off. It decides nothing about the
run itself (a left-out section still validates, and ``config.yaml`` in the run dir holds all).
"""

from __future__ import annotations

from sluice.config.agentic import AgenticConfig
from sluice.config.fleet import FleetConfig
from sluice.config.models import SluiceConfig


def unused_sections(config: SluiceConfig, task_env: str | None) -> list[str]:
    """The sections ``config`` leaves unread (``task_env``: the built-in task's environment)."""
    task_used = not (config.data.train_files and config.model.path)  # its model, prompts or held-out set
    unused = [] if task_used else ["task"]
    unused += [engine for engine in ("vllm", "sglang") if config.rollout.engine != engine]
    multi_turn = config.agentic != AgenticConfig() or (task_used and task_env is not None)
    unused += [] if multi_turn else ["agentic"]
    unused += ["fleet"] if config.fleet == FleetConfig() else []
    return unused

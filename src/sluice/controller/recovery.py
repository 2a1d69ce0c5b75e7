"""In-run recovery (``run.max_restarts``): which stops a run recovers from by itself, and its budget.

A worker that died or stalled (``WorkerDied`` / ``WorkerStalled``: the trainer, a queue storage
unit or controller, a weight registry, a queue-task worker, the rollout worker past Ray's own
restarts, a training loop that stopped moving) is recoverable: ``RLTrainer.fit`` has already torn
the workers down (``controller/training.py``'s ``finally``) and runs the loop again from the last
complete checkpoint, through the very path ``resume=auto`` takes (``open_checkpoints``: the logs
cut back to it, newer leftovers removed), or from the start if no checkpoint was written yet; at
most ``run.max_restarts`` times a run, each restart one warning and one ``restart`` record with
its cause. Past the budget the stop propagates with its own line.

Not recoverable: a stop asked by SIGTERM / SIGINT (the run must end), a failure budget spent (a
reward that fails would fail again), a refused write, a config or data error.

Not here: tearing down or placing workers (``training.py``), reading checkpoints (``resume.py``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.config import SluiceConfig
from sluice.controller.run_state import METRICS_LOG, TrainingRun
from sluice.runtime.supervision import RESUME_HINT, WorkerDied, WorkerStalled

log = logging.getLogger(__name__)


@dataclass
class Recovery:
    """The restarts of one ``fit``: ``budget`` (``run.max_restarts``) and the causes so far."""

    budget: int
    causes: list[str] = field(default_factory=list)
    """Each restart's cause: the stop's one line, without its resume hint."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """Each restart's ``restart`` record (``metrics.jsonl``)."""

    def restarts(self, err: BaseException, stop_asked: bool) -> bool:
        """Whether the run continues after ``err`` (then counted and said in one warning)."""
        if stop_asked or not isinstance(err, WorkerDied | WorkerStalled):
            return False
        if len(self.causes) >= self.budget:
            return False
        cause = str(err).removesuffix(f"; {RESUME_HINT}")
        self.causes.append(cause)
        log.warning(
            "restart %d of %d (run.max_restarts): %s; continuing from the last complete checkpoint",
            len(self.causes), self.budget, cause,
        )  # fmt: skip
        return True

    def config(self, config: SluiceConfig) -> SluiceConfig:
        """The config an attempt opens its checkpoints with: after a restart, ``run.resume=auto``."""
        if not self.causes:
            return config
        return config.model_copy(update={"run": config.run.model_copy(update={"resume": "auto"})})

    def record(self, run: TrainingRun, resumed_from: Path | None, version: int) -> None:
        """This attempt's ``restart`` record (after the logs were cut back to its checkpoint, of
        step ``version``; 0: from the start), and again any earlier restart's record the cut took
        with it (two restarts from one checkpoint): every restart keeps its record."""
        if not self.causes:
            return
        self.records.append(
            {
                "restart": len(self.causes),
                "max_restarts": self.budget,
                "cause": self.causes[-1],
                "checkpoint": None if resumed_from is None else str(resumed_from),
                "step": version,
            }
        )
        kept = _logged_restarts(run.run_dir / METRICS_LOG)
        for record in self.records:
            if record["restart"] not in kept:
                run.metrics.log("restart", **record)


def _logged_restarts(path: Path) -> set[int]:
    """The ``restart`` numbers of the records in the metrics log ``path``."""
    if not path.is_file():
        return set()
    with path.open() as lines:
        records = [json.loads(line) for line in lines if '"restart"' in line and line.endswith("\n")]
    return {int(r["restart"]) for r in records if r.get("kind") == "restart"}

"""What a checkpoint holds for each loop, and how a run captures it and continues from it.

Both loops checkpoint at a step boundary (the trainer between steps). ``mode: sync``: the train
engine (and critic), the version, the dataset cursor, the counters, the RNG. ``mode: async`` adds
the controller's books as one synchronous cut — the ledger (every group's state, versions,
counters, staleness credits), the reports of groups not yet trained, the next group id and the
prompts of groups still generating — and the queue's rows of the groups that were written and
not yet trained. Admission and generation never pause: groups still generating at the cut are
restarted on resume with the same ids and prompts (``regenerated_restart_groups``), groups that
finish after the cut are dropped from the snapshot, so every admitted group is trained exactly
once. Each step's trained sample ids go to ``trained_ids.jsonl``, cut back with the metrics on
resume.

It does not schedule anything (the loops call it) and knows no file layout beyond
``controller/checkpoint.py``'s.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.api import GroupReport, PromptItem
from sluice.controller.async_loop import AsyncController
from sluice.controller.checkpoint import (
    TRAINER_DIR,
    CheckpointError,
    CheckpointStore,
    config_changes,
    log_sizes,
    read_driver_state,
    resolve_resume,
    truncate_log,
    write_driver_state,
)
from sluice.controller.ledger import GroupLedger, GroupState
from sluice.rollout.evaluate import EvalResult
from sluice.telemetry import JsonlMetrics
from sluice.trainer.rng_state import capture_rng, restore_rng

log = logging.getLogger(__name__)

LOGS = ("metrics.jsonl", "trained_ids.jsonl")


@dataclass
class AsyncCut:
    """The asynchronous controller's books at a step boundary."""

    next_group: int
    ledger: GroupLedger
    reports: dict[int, GroupReport]
    """Reports of groups written to the queue and not yet trained."""
    regenerate: list[tuple[PromptItem, int]]
    """Groups still generating: restarted on resume."""
    queue: dict[str, Any] = field(default_factory=dict)
    """The queue's rows of the written, untrained groups (``queue_state_of``)."""


@dataclass
class DriverState:
    version: int
    mode: str
    config: dict[str, Any]
    prompt_position: int
    base_eval: EvalResult
    logs: dict[str, int]
    rng: dict[str, Any]
    sync_counters: dict[str, Any] = field(default_factory=dict)
    cut: AsyncCut | None = None


def open_run(trainer: Any) -> DriverState | None:
    """Start the run's logs; with ``run.resume``, load the checkpoint's driver state and cut the
    logs back to it (``None`` when starting fresh). Checkpoints newer than the resumed one belong
    to the abandoned continuation and are removed."""
    cfg = trainer.config
    trainer.checkpoints = CheckpointStore(trainer.run_dir, cfg.run.keep_checkpoints)
    path = resolve_resume(cfg.run.resume, trainer.run_dir)
    state: DriverState | None = None
    if path is not None:
        state = read_driver_state(path)
        changed = config_changes(state.config, cfg.model_dump(mode="json"))
        if changed:
            raise CheckpointError(f"run.resume: {path} was written with a different config: {', '.join(changed)}")
        for name in LOGS:
            truncate_log(trainer.run_dir / name, state.logs.get(name, 0))
        trainer.checkpoints.drop_newer_than(state.version)
        log.warning("resuming %s from %s (version %d)", trainer.run_dir, path, state.version)
    trainer.resumed_from = path
    trainer.metrics = JsonlMetrics(trainer.run_dir / LOGS[0], append=state is not None)
    trainer.trained_ids_log = JsonlMetrics(trainer.run_dir / LOGS[1], append=state is not None)
    return state


def checkpoint_due(trainer: Any, version: int) -> bool:
    every = trainer.config.run.checkpoint_every
    return bool(every) and version % every == 0


def save_sync_checkpoint(trainer: Any, version: int) -> Path:
    """``mode: sync``: everything lives in this process."""
    tmp = trainer.checkpoints.begin(version)
    trainer.train_engine.save(str(tmp / TRAINER_DIR))
    if trainer.critic is not None:
        trainer.critic.save(tmp)
    counters = {"next_group": trainer._next_group, "trained_groups": trainer._trained_groups}
    state = _driver_state(trainer, version, {**counters, "discards": Counter(trainer.discards)})
    write_driver_state(tmp, state)
    return trainer.checkpoints.commit(tmp, version)


def restore_sync(trainer: Any, state: DriverState) -> EvalResult:
    """Load a ``mode: sync`` checkpoint into a freshly built trainer; the engine gets its weights."""
    folder = trainer.resumed_from
    trainer.train_engine.load(str(folder / TRAINER_DIR))
    if trainer.critic is not None:
        trainer.critic.load(folder)
    counters = state.sync_counters
    trainer._next_group, trainer._trained_groups = counters["next_group"], counters["trained_groups"]
    trainer.discards = Counter(counters["discards"])
    _restore_common(trainer, state)
    trainer.sync_actor_model()
    return state.base_eval


async def save_async_checkpoint(trainer: Any, controller: AsyncController, pipeline: Any, version: int) -> Path:
    """``mode: async``, between steps: the cut first (synchronous, so consistent), then the
    trainer's state and the queue, while generation goes on."""
    cut = capture_cut(controller)
    state = _driver_state(trainer, version, {})
    tmp = trainer.checkpoints.begin(version)
    await pipeline.save_state(str(tmp / TRAINER_DIR))
    written = {gid for gid, g in cut.ledger.groups.items() if g.state is GroupState.OPEN and g.generated}
    cut.queue = queue_state_of(await pipeline.queue_snapshot(), written)
    state.cut = cut
    write_driver_state(tmp, state)
    return await asyncio.to_thread(trainer.checkpoints.commit, tmp, version)


async def restore_async(trainer: Any, pipeline: Any, state: DriverState) -> EvalResult:
    """Load the trainer's state, bring the engines to its version, refill the queue."""
    version = await pipeline.load_state(str(trainer.resumed_from / TRAINER_DIR))
    await pipeline.sync_weights(version)
    assert state.cut is not None, "not an async checkpoint"
    await pipeline.queue_restore(state.cut.queue)
    _restore_common(trainer, state)
    return state.base_eval


def resume_controller(controller: AsyncController, state: DriverState) -> None:
    assert state.cut is not None, "not an async checkpoint"
    cut = state.cut
    controller.resume(copy.deepcopy(cut.ledger), cut.reports, cut.next_group, cut.regenerate)


def capture_cut(controller: AsyncController) -> AsyncCut:
    """The controller's books now, deep-copied (the run goes on while the checkpoint is written)."""
    ledger = copy.deepcopy(controller.ledger)
    open_groups = {gid: g for gid, g in ledger.groups.items() if g.state is GroupState.OPEN}
    generating = controller.generating_prompts()
    regenerate = [(generating[gid], gid) for gid, g in sorted(open_groups.items()) if not g.generated]
    reports = {gid: controller.reports[gid] for gid, g in open_groups.items() if g.generated}
    return AsyncCut(controller.next_group, ledger, reports, regenerate)


def queue_state_of(snapshot: dict[str, Any], group_ids: set[int]) -> dict[str, Any]:
    """A queue snapshot reduced to the rows of ``group_ids``, with every task's readiness
    rebuilt from the columns those rows hold and nothing consumed: the rows are untrained, and a
    task that had already read one (the frozen reference) reads it again and writes the same
    values. Rows written after the cut, and trained rows, are left out."""
    storage = snapshot["storage"]
    meta = [row for row in storage["meta"] if row[1] in group_ids]  # [index, group_id, ...]
    keep = {row[0] for row in meta}
    columns: dict[str, dict[str, list[Any]]] = {}
    for name, col in storage["columns"].items():
        pairs = [(i, v) for i, v in zip(col["indices"], col["values"], strict=True) if i in keep]
        columns[name] = {"indices": [i for i, _ in pairs], "values": [v for _, v in pairs]}
    present = {name: set(col["indices"]) for name, col in columns.items()}
    tasks = {}
    for task, ctl in snapshot["tasks"].items():
        inputs = list(ctl["input_columns"])
        ready, pending = [], []
        for row in meta:
            missing = sorted(c for c in inputs if row[0] not in present.get(c, ()))
            if missing:
                pending.append([row, missing])
            else:
                ready.append(row)
        tasks[task] = {"input_columns": inputs, "ready": ready, "pending": pending, "consumed": [], "partitions": []}
    return {"storage": {"meta": meta, "columns": columns, "freed": []}, "tasks": tasks, "partitions": [], "ledger": []}


def _driver_state(trainer: Any, version: int, sync_counters: dict[str, Any]) -> DriverState:
    return DriverState(
        version=version,
        mode=trainer.config.run.mode,
        config=trainer.config.model_dump(mode="json"),
        prompt_position=trainer.prompts.position,
        base_eval=trainer.base_eval,
        logs=log_sizes({name: trainer.run_dir / name for name in LOGS}),
        rng=capture_rng(),
        sync_counters=sync_counters,
    )


def _restore_common(trainer: Any, state: DriverState) -> None:
    trainer.version = state.version
    trainer.prompts.position = state.prompt_position
    restore_rng(state.rng)

"""What a checkpoint holds, and how a run captures it and continues from it.

Every mode checkpoints at a step boundary (the trainer between steps): the trainer's state
(weights, optimizer, critic, RNG, version), the dataset cursor, the RNG, and the controller's
books as one synchronous cut — the ledger (every group's state, versions, counters, staleness
credits), the reports of groups not yet trained, the next group id and the prompts of groups
still generating — and the queue's rows of the groups that were written and not yet trained.
Admission and generation never pause: groups still generating at the cut are restarted on resume
with the same ids and prompts (``regenerated_restart_groups``), groups that finish after the cut
are dropped from the snapshot, so every admitted group is trained exactly once. Each step's
trained sample ids go to ``trained_ids.jsonl``, cut back with the metrics on resume.

It does not schedule anything (the loop calls it), knows no file layout beyond
``controller/checkpoint.py``'s and no queue layout (the pipeline hands it the queue's own state).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sluice.api import GroupReport, PromptItem
from sluice.config import SluiceConfig
from sluice.controller.checkpoint import (
    TRAINER_DIR,
    CheckpointError,
    CheckpointStore,
    config_changes,
    data_changes,
    data_fingerprint,
    drop_cut_line,
    log_sizes,
    open_run,
    read_manifest,
    resumable_text,
    set_aside,
    truncate_log,
    verify_checkpoint,
    write_driver_state,
)
from sluice.controller.checkpoint import read_driver_state as read_state_file
from sluice.controller.consistency import check_consistent
from sluice.controller.cut import AsyncCut
from sluice.controller.run_state import LOGS, TrainingRun
from sluice.rollout.evaluate import EvalResult, EvalScores
from sluice.schedule.ledger import GroupLedger, GroupRecord, GroupState
from sluice.schedule.staleness import StalenessGate
from sluice.telemetry.disk_faults import disk_faults
from sluice.trainer.rng_state import capture_rng, restore_rng

log = logging.getLogger(__name__)


class CheckpointedPipeline(Protocol):
    """What a checkpoint needs from the pipeline's workers."""

    async def save_state(self, path: str) -> None: ...

    async def load_state(self, path: str) -> int: ...

    async def sync_weights(self, version: int) -> dict[str, float]: ...

    async def queue_snapshot(self, group_ids: set[int]) -> dict[str, Any]: ...

    async def queue_restore(self, state: dict[str, Any]) -> None: ...


@dataclass
class DriverState:
    version: int
    mode: str
    config: dict[str, Any]
    prompt_position: int
    base_eval: EvalResult | None
    """The run's base evaluation (``None``: the run does not evaluate)."""
    logs: dict[str, int]
    rng: dict[str, Any]
    cut: AsyncCut
    rollout_replicas: int | None = None
    """The rollout's replicas as ``fleet.rebalance`` left them (``None``: not rebalanced, or a
    checkpoint from before the count was kept); a resume starts with them."""


def open_checkpoints(config: SluiceConfig, run_dir: Path) -> tuple[CheckpointStore, Path | None, DriverState | None]:
    """The run's checkpoint store and, with ``run.resume``, the checkpoint continued and its driver
    state (``None`` s when starting fresh). Nothing is cut or removed before that checkpoint
    verified and its state was read: then the logs are cut back to it and this run's newer
    checkpoints (the abandoned continuation) are removed. With ``resume=auto`` a checkpoint that
    fails is renamed ``*.rejected`` (logged with its reason) and the previous one is tried."""
    run_id, candidates = open_run(run_dir, config.run.resume)
    data = data_fingerprint([*config.data.train_files, *config.data.val_files])
    store = CheckpointStore(run_dir, config.run.keep_checkpoints, run_id, data)
    if not candidates:
        return store, None, None
    path, state, rejected = _first_usable(candidates, explicit=config.run.resume != "auto")
    changed = config_changes(state.config, config.model_dump(mode="json"))
    if changed:
        raise CheckpointError(
            f"run.resume: {path} was written with a different config: {', '.join(changed)} changed; "
            f"a resume may change only {resumable_text()}; start a new run.name for the rest"
        )
    files = data_changes(read_manifest(path)["data"], data)
    if files:
        raise CheckpointError(
            f"run.resume: data file {files[0]} changed since {path} was written (SHA-256 differs"
            f"{f'; {len(files)} files in all' if len(files) > 1 else ''}); resume with the same data or "
            "start a new run.name"
        )
    for bad, reason in rejected:
        log.warning("checkpoint %s is unusable (%s): kept as %s; resuming from %s", bad, reason, set_aside(bad), path)
    for name in LOGS:
        truncate_log(run_dir / name, state.logs.get(name, 0))
        dropped = drop_cut_line(run_dir / name)  # appending to a cut line would corrupt the next record
        if dropped:
            short = state.logs.get(name, 0) - (run_dir / name).stat().st_size
            lost = f"; it now holds {short} bytes less than {path.name} recorded" if short > 0 else ""
            log.warning("%s: its last line was cut mid-line: dropped (%d bytes)%s", run_dir / name, dropped, lost)
    store.drop_newer_than(state.version)
    log.warning("resuming %s from %s (version %d)", run_dir, path, state.version)
    return store, path, state


def _first_usable(candidates: list[Path], explicit: bool) -> tuple[Path, DriverState, list[tuple[Path, str]]]:
    """The newest candidate that verifies and whose driver state reads, and the ones that failed
    (with why). An explicit ``run.resume`` path that fails, or no usable candidate, is an error."""
    failed: list[tuple[Path, str]] = []
    for path in candidates:
        try:  # deliberately: a damaged checkpoint falls back to the previous one
            verify_checkpoint(path)  # before any file in it is read (the driver's, DCP's metadata)
            state = read_driver_state(path)
            check_consistent(path, state.version, state.cut)  # folder name, manifest, driver, trainer, queue agree
            return path, state, failed
        except CheckpointError as err:
            if explicit:
                raise
            failed.append((path, str(err).removeprefix("run.resume: ")))
    listed = "; ".join(f"{p.name}: {why}" for p, why in failed)
    raise CheckpointError(f"run.resume: no usable checkpoint in {candidates[0].parent} ({listed})")


_STATE_TYPES = (DriverState, AsyncCut, GroupLedger, GroupRecord, GroupState, StalenessGate, GroupReport, PromptItem)
STATE_CLASSES: dict[str, type] = {cls.__name__: cls for cls in (*_STATE_TYPES, EvalResult, EvalScores)}
"""The classes a checkpoint's driver state may hold (``state_codec`` builds no other)."""


def read_driver_state(path: Path) -> DriverState:
    """The driver state of the checkpoint at ``path`` (verified first: ``verify_checkpoint``)."""
    state = read_state_file(path, STATE_CLASSES)
    if not isinstance(state, DriverState):
        raise CheckpointError(f"run.resume: {path} holds no driver state")
    return state


async def save_checkpoint(run: TrainingRun, cut: AsyncCut, pipeline: CheckpointedPipeline, version: int) -> Path:
    """Between steps: the books' ``cut`` first (the admission's: the driver's books, or a
    multi-controller run's gate and shards), then the trainer's state and the queue's rows of the cut's written groups,
    while generation goes on."""
    state = _driver_state(run, version, cut)
    with disk_faults(run.checkpoints.root, any_error=True):  # a full disk: one line, older checkpoints kept
        tmp = run.checkpoints.begin(version)
        await pipeline.save_state(str(tmp / TRAINER_DIR))
        cut.queue = await pipeline.queue_snapshot(set(cut.reports))
        write_driver_state(tmp, state, STATE_CLASSES)
        return await asyncio.to_thread(run.checkpoints.commit, tmp, version, _believe)


async def restore_checkpoint(run: TrainingRun, pipeline: CheckpointedPipeline, state: DriverState) -> EvalResult | None:
    """Load the trainer's state, bring the engines to its version, refill the queue."""
    assert run.resumed_from is not None, "restore a resumed run only"
    version = await pipeline.load_state(str(run.resumed_from / TRAINER_DIR))
    await pipeline.sync_weights(version)
    await pipeline.queue_restore(state.cut.queue)
    run.version = state.version
    run.prompts.position = state.prompt_position
    restore_rng(state.rng)
    return state.base_eval


def _believe(path: Path) -> None:
    """A checkpoint just written, read back as a resume would read it: its parts agree."""
    state = read_driver_state(path)
    check_consistent(path, state.version, state.cut)


def _driver_state(run: TrainingRun, version: int, cut: AsyncCut) -> DriverState:
    return DriverState(
        version=version,
        mode=run.config.run.mode,
        config=run.config.model_dump(mode="json"),
        prompt_position=run.prompts.position,
        base_eval=run.base_eval,
        logs=log_sizes({name: run.run_dir / name for name in LOGS}),
        rng=capture_rng(),
        cut=cut,
        rollout_replicas=run.rollout_replicas,
    )

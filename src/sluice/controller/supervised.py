"""What ``sluice sft`` and ``sluice rm`` share around their steps: ranks, the run log, checkpoints.

Both are a loop of optimizer steps over the user's rows on one ``HFTrainEngine`` (a causal LM for
``sft``, a scalar reward model for ``rm``); this module holds everything around that loop so the
two runs differ only in their rows, their step and their evaluation: ``run_ranks`` (this process,
plus spawned ranks under ``trainer.strategy: ddp / fsdp2``), ``RunLog`` (rank 0's outputs),
checkpoints whose state file, written last, makes them complete, and ``resume_step``
(``run.resume=auto`` or a named checkpoint). It does not choose rows, step or evaluate.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from sluice.config import ConfigError, SluiceConfig, dump_config
from sluice.controller.checkpoint import truncate_log
from sluice.engines.hf_train import HFTrainEngine
from sluice.telemetry import TrainProgress
from sluice.telemetry.metrics import JsonlMetrics
from sluice.telemetry.plot import METRICS_LOG, plot_run
from sluice.telemetry.trackers import open_trackers
from sluice.trainer.data_parallel import DataParallelGroup
from sluice.trainer.rendezvous import free_tcp_address

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE_FILE = "sft_state.json"
"""Written last into a checkpoint folder: its presence makes the checkpoint complete."""
FINAL_MODEL = "final_model"

Result = TypeVar("Result")
RankRun = Callable[[SluiceConfig, "tuple[str, int] | None", "TrainProgress | None", int], Result]
"""One rank's run: ``(cfg, (address, world) or None, progress, rank) -> result``."""


def run_ranks(cfg: SluiceConfig, run_rank: RankRun[Result], progress: TrainProgress | None, command: str) -> Result:
    """``run_rank`` in this process (rank 0), plus ``resources.trainer.ranks - 1`` spawned ranks
    under ``trainer.strategy: ddp / fsdp2``; rank 0's result."""
    if cfg.trainer.strategy == "single":
        return run_rank(cfg, None, progress, 0)
    address, world = free_tcp_address(), cfg.resources.trainer.ranks
    spawn = torch.multiprocessing.get_context("spawn")
    others = [spawn.Process(target=_other_rank, args=(run_rank, cfg, rank, world, address)) for rank in range(1, world)]
    for process in others:
        process.start()
    try:
        result = run_rank(cfg, (address, world), progress, 0)
    except BaseException:
        for process in others:  # they would wait for this rank's collectives forever
            process.terminate()
        raise
    for rank, process in enumerate(others, start=1):
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"sluice {command}: rank {rank} exited with code {process.exitcode}")
    return result


def leave_if_spawned(rank: int) -> None:
    """The end of a spawned rank's run, called while its objects still live: the process exits
    at once. Freeing them could deadlock in ``torch.distributed``'s teardown: dropping a DDP
    model frees its gloo process group, whose destructor joins the group's threads holding the
    GIL while one of them waits for the GIL to drop a finished collective's tensor (``sluice rm``'s
    DDP ranks hung so, after their last step); rank 0 waits for this process to end."""
    if rank != 0:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _other_rank(run_rank: RankRun[Any], cfg: SluiceConfig, rank: int, world: int, address: str) -> None:
    """A spawned rank's run (which ends in ``leave_if_spawned``), or its error and an immediate
    exit: once the process group is gone, tearing down the interpreter could block in a
    ``torch.distributed`` object's destructor, and rank 0 waits for this process to end."""
    code = 0
    try:
        run_rank(cfg, (address, world), None, rank)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def context_length(model_dir: str | Path) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2048)


class RunLog:
    """Rank 0's outputs: ``config.yaml``, ``metrics.jsonl``, the trackers, progress, ``plot.png``.
    ``loss_key``: the train record's loss that the progress line shows."""

    def __init__(
        self,
        cfg: SluiceConfig,
        run_dir: Path,
        resumed: int,
        progress: TrainProgress | None,
        steps: int,
        loss_key: str,
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        self.cfg, self.run_dir, self.progress, self.loss_key = cfg, run_dir, progress, loss_key
        self.metrics = JsonlMetrics(run_dir / METRICS_LOG, append=resumed > 0)
        self.trackers = open_trackers(cfg.tracking, run_dir, cfg.model_dump(), resume=resumed > 0)
        self.val_loss: float | None = None
        if progress is not None:
            progress.set_total(steps)

    def record(self, kind: str, step: int, values: dict[str, float]) -> None:
        record = self.metrics.log(kind, step=step, **values)
        self.trackers.log_record(kind, step, record)
        self.val_loss = values.get("val_loss", self.val_loss)

    def step(self, step: int, train: dict[str, float], scores: dict[str, float] | None) -> None:
        self.record("train", step, train)
        if scores is not None:
            self.record("eval", step, scores)
        if self.progress is not None:
            self.progress.update(step, loss=train[self.loss_key], val_loss=self.val_loss)

    def close(self, failed: bool) -> None:
        self.trackers.close(failed)
        if self.cfg.tracking.plot and not failed:
            plot_run(self.run_dir)


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    root = run_dir / CHECKPOINTS
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def save_checkpoint(
    engine: HFTrainEngine, run_dir: Path, step: int, keep: int, log_to: RunLog | None, group: DataParallelGroup | None
) -> None:
    """Weights, optimizer and LR schedule (every rank: ``fsdp2`` writes shards), then rank 0's
    state file (last, once every rank wrote: the folder is complete) with the length
    ``metrics.jsonl`` had, which a resume cuts it back to."""
    folder = run_dir / CHECKPOINTS / f"step_{step:06d}"
    if log_to is not None:
        shutil.rmtree(folder, ignore_errors=True)
    if group is not None:
        group.all_gather(None)  # the old folder is gone before anyone writes
    engine.save(str(folder))
    if group is not None:
        group.all_gather(None)
    if log_to is None:
        return
    path = log_to.metrics.path
    size = path.stat().st_size if path is not None else 0
    (folder / STATE_FILE).write_text(json.dumps({"step": step, "metrics_bytes": size}))
    for old in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)


def resume_step(cfg: SluiceConfig, run_dir: Path, engine: HFTrainEngine, command: str) -> int:
    """The step a ``run.resume`` continues from (0: a fresh run), its checkpoint loaded."""
    if cfg.run.resume is None:
        return 0
    if cfg.run.resume == "auto":
        found = checkpoints(run_dir)
        if not found:
            return 0
        folder = found[-1]
    else:
        folder = Path(cfg.run.resume)
        if not (folder / STATE_FILE).is_file():
            raise ConfigError(f"run.resume: {folder} is not a complete sluice {command} checkpoint (no {STATE_FILE})")
    engine.load(str(folder))
    state = json.loads((folder / STATE_FILE).read_text())
    if (run_dir / METRICS_LOG).is_file():
        truncate_log(run_dir / METRICS_LOG, int(state["metrics_bytes"]))  # records after the checkpoint go
    step = int(state["step"])
    log.info("%s: resumed from %s (step %d)", command, folder, step)
    return step


def run_steps(
    cfg: SluiceConfig,
    engine: HFTrainEngine,
    tokenizer: Any,
    steps: tuple[int, int],
    train_step: Callable[[int], dict[str, float]],
    evaluate: Callable[[int], dict[str, float]] | None,
    log_to: RunLog | None,
    group: DataParallelGroup | None,
) -> tuple[Path, dict[str, float]]:
    """Steps ``resumed .. total`` (``steps``) of ``train_step(step)`` (0-based), evaluated before
    the first (a fresh run), every ``run.eval_every`` steps and after the last, checkpointed every
    ``run.checkpoint_every``; then ``final_model/`` with the tokenizer. Returns it and the last
    evaluation's values."""
    resumed, total = steps
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    scores: dict[str, float] = {}
    failed = True
    try:
        if resumed == 0 and evaluate is not None:
            scores = evaluate(0)
            if log_to is not None:
                log_to.record("eval", 0, scores)
        for step in range(resumed, total):
            record = train_step(step)
            due = evaluate is not None and ((step + 1) % cfg.run.eval_every == 0 or step + 1 == total)
            if due and evaluate is not None:
                scores = evaluate(step + 1)
            if log_to is not None:
                log_to.step(step + 1, record, scores if due else None)
            if cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0 and step + 1 < total:
                save_checkpoint(engine, run_dir, step + 1, cfg.run.keep_checkpoints, log_to, group)
        final = run_dir / FINAL_MODEL
        engine.save(str(final), optimizer=False)  # every rank: an fsdp2 model is gathered
        if engine.rank == 0:
            tokenizer.save_pretrained(final)
        failed = False
    finally:
        if log_to is not None:
            log_to.close(failed)
        if group is not None:
            group.close()
    return final, scores

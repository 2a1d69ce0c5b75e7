"""``sluice sft``: supervised fine-tuning of a model folder on the user's rows, end to end.

The run reads ``data.train_files`` / ``val_files`` (``data/readers.py``), renders each row into
tokens and loss tokens (``data/conversations.py``), and steps the RL trainer's engine with the
supervised loss (``trainer/sft.py``) for ``sft.epochs`` passes or ``sft.steps`` steps of
``sft.batch_size`` rows. Every ``run.eval_every`` steps (and before the first and after the last)
it logs the validation loss and, with a reward configured, the greedy accuracy through the same
evaluator as ``sluice train`` (``rollout/evaluate.py``). It writes ``metrics.jsonl``, the trackers'
records, ``plot.png``, checkpoints every ``run.checkpoint_every`` steps (``resume=auto`` continues
the newest: the row order is a function of the step, so the same rows follow), and
``final_model/``, a model folder ``sluice train`` takes as ``model.path``.

Under ``trainer.strategy: ddp / fsdp2`` it spawns ``resources.trainer.ranks - 1`` more processes
(one ``torch.distributed`` group: gloo on CPU, NCCL on CUDA); every rank reads the rows, takes
every ``world``-th row of each step and normalises by the whole step's loss tokens, so the update
equals one process's up to float rounding; rank 0 logs and writes. Deliberately not here: the
step itself (``trainer/sft.py``), row rendering (``data/conversations.py``), the evaluation
(``controller/sft_eval.py``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.api import Sample
from sluice.config import ConfigError, SluiceConfig, dump_config
from sluice.controller.checkpoint import truncate_log
from sluice.controller.sft_eval import SftEvaluation
from sluice.data import DatasetError, read_rows
from sluice.data.conversations import ConversationRenderer, ExampleSet
from sluice.engines.hf_model import load_tokenizer
from sluice.engines.hf_train import HFTrainEngine
from sluice.preflight import check_sft
from sluice.telemetry import TrainProgress
from sluice.telemetry.metrics import JsonlMetrics
from sluice.telemetry.plot import METRICS_LOG, plot_run
from sluice.telemetry.trackers import open_trackers
from sluice.trainer.data_parallel import DataParallelGroup, free_tcp_address
from sluice.trainer.sections import train_engine
from sluice.trainer.sft import SFT_LOSS, as_sample, batch_rows, sft_step, total_steps

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE_FILE = "sft_state.json"
"""Written last into a checkpoint folder: its presence makes the checkpoint complete."""
FINAL_MODEL = "final_model"


@dataclass(frozen=True)
class SftResult:
    steps: int
    minutes: float
    final_model_dir: Path
    val_loss: float | None
    accuracy: float | None
    filtered: int
    """Training and validation rows over ``sft.max_length`` that were dropped."""
    resumed_from: int = 0
    """The checkpoint's step a ``run.resume`` continued from (0: a fresh run)."""


@dataclass
class SftData:
    """A run's rows as samples (``train``, ``val``) and how many were dropped."""

    train: list[Sample]
    val: list[Sample]
    filtered: int
    tokenizer: Any


def load_sft_data(cfg: SluiceConfig, model_dir: str | Path) -> SftData:
    """Every training and validation row of ``cfg.data``, rendered and checked."""
    tokenizer = load_tokenizer(model_dir)
    limit = cfg.sft.max_length or _context_length(model_dir)
    renderer = ConversationRenderer(tokenizer, cfg.data, cfg.sft, limit)
    train, val = _examples(renderer, cfg.data.train_files), _examples(renderer, cfg.data.val_files)
    if not train.examples:
        dropped = train.filtered["too_long"]
        why = f"all {dropped} are over sft.max_length ({limit})" if dropped else "the files hold none"
        raise DatasetError(f"data.train_files: no training rows: {why}")
    samples = [as_sample(e.ids, e.train, i) for i, e in enumerate(train.examples)]
    held = [as_sample(e.ids, e.train, i) for i, e in enumerate(val.examples)]
    return SftData(samples, held, sum(train.filtered.values()) + sum(val.filtered.values()), tokenizer)


def _examples(renderer: ConversationRenderer, files: tuple[str, ...]) -> ExampleSet:
    out = ExampleSet()
    for path in files:
        part = renderer.build(read_rows(path))
        out.examples += part.examples
        out.filtered.update(part.filtered)
    return out


def _context_length(model_dir: str | Path) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2048)


def run_sft(cfg: SluiceConfig, progress: TrainProgress | None = None) -> SftResult:
    """The whole ``sluice sft`` run (see the module docstring): this process, plus
    ``resources.trainer.ranks - 1`` spawned ranks under ``trainer.strategy: ddp / fsdp2``."""
    check_sft(cfg)
    if cfg.trainer.strategy == "single":
        return _run_rank(cfg, None, progress)
    address, world = free_tcp_address(), cfg.resources.trainer.ranks
    spawn = torch.multiprocessing.get_context("spawn")
    others = [spawn.Process(target=_other_rank, args=(cfg, rank, world, address)) for rank in range(1, world)]
    for process in others:
        process.start()
    try:
        result = _run_rank(cfg, (address, world), progress)
    except BaseException:
        for process in others:  # they would wait for this rank's collectives forever
            process.terminate()
        raise
    for rank, process in enumerate(others, start=1):
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"sluice sft: rank {rank} exited with code {process.exitcode}")
    return result


def _other_rank(cfg: SluiceConfig, rank: int, world: int, address: str) -> None:
    """A spawned rank's run, then an immediate exit: once the process group is gone, tearing down
    the interpreter could block in a ``torch.distributed`` object's destructor (seen with DDP), and
    rank 0 waits for this process to end."""
    code = 0
    try:
        _run_rank(cfg, (address, world), None, rank)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_rank(
    cfg: SluiceConfig, group_at: tuple[str, int] | None, progress: TrainProgress | None, rank: int = 0
) -> SftResult:
    """One rank's run (rank 0 logs, evaluates with a reward, writes the run dir's files)."""
    started = time.monotonic()
    torch.set_num_threads(cfg.run.threads or torch.get_num_threads())
    torch.manual_seed(cfg.run.seed)
    run_dir, model_dir = Path(cfg.run.output_dir) / cfg.run.name, cfg.model.path or ""
    data = load_sft_data(cfg, model_dir)
    n, batch = len(data.train), cfg.sft.batch_size
    steps = total_steps(n, batch, cfg.sft.epochs, cfg.sft.steps)
    limit = None if cfg.sft.steps is not None else round(cfg.sft.epochs * n)
    engine = train_engine(model_dir, cfg.trainer, 1.0, steps)
    group = None if group_at is None else DataParallelGroup(group_at[0], rank, group_at[1], engine.device)
    if group is not None:
        engine.distribute(cfg.trainer.strategy, cpu_offload=cfg.trainer.cpu_offload)
    resumed = _resume_step(cfg, run_dir, engine)
    log_to = _RunLog(cfg, run_dir, resumed, progress, steps) if rank == 0 else None
    evaluation = SftEvaluation(cfg, data.val, data.tokenizer, model_dir, group)
    log.info("sft: %d rows (%d dropped), %d steps of %d rows, from step %d", n, data.filtered, steps, batch, resumed)
    scores: dict[str, float] = {}
    if resumed == 0 and evaluation.enabled:
        scores = evaluation(engine, 0)
        if log_to is not None:
            log_to.record("eval", 0, scores)
    failed = True
    try:
        for step in range(resumed, steps):
            rows = [data.train[i] for i in batch_rows(n, batch, step, cfg.run.seed, limit)]
            record = _train_step(engine, rows, cfg.trainer.micro_batch_tokens, (step + 1) * batch / n, group)
            due = evaluation.enabled and ((step + 1) % cfg.run.eval_every == 0 or step + 1 == steps)
            if due:
                scores = evaluation(engine, step + 1)
            if log_to is not None:
                log_to.step(step + 1, record, scores if due else None)
            if cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0 and step + 1 < steps:
                _save_checkpoint(engine, run_dir, step + 1, cfg.run.keep_checkpoints, log_to, group)
        final = run_dir / FINAL_MODEL
        engine.save(str(final), optimizer=False)  # every rank: an fsdp2 model is gathered
        if rank == 0:
            data.tokenizer.save_pretrained(final)
        failed = False
    finally:
        if log_to is not None:
            log_to.close(failed)
        if group is not None:
            group.close()
    minutes = (time.monotonic() - started) / 60
    return SftResult(steps, minutes, final, scores.get("val_loss"), scores.get("accuracy"), data.filtered, resumed)


class _RunLog:
    """Rank 0's outputs: ``config.yaml``, ``metrics.jsonl``, the trackers, progress, ``plot.png``."""

    def __init__(
        self, cfg: SluiceConfig, run_dir: Path, resumed: int, progress: TrainProgress | None, steps: int
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        self.cfg, self.run_dir, self.progress = cfg, run_dir, progress
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
            self.progress.update(step, loss=train["sft_loss"], val_loss=self.val_loss)

    def close(self, failed: bool) -> None:
        self.trackers.close(failed)
        if self.cfg.tracking.plot and not failed:
            plot_run(self.run_dir)


def _train_step(
    engine: HFTrainEngine, rows: list[Sample], micro_batch_tokens: int, epoch: float, group: DataParallelGroup | None
) -> dict[str, float]:
    """One step on ``rows`` (with ranks: this rank's share, normalised by all of them)."""
    began = time.perf_counter()
    mine = rows if group is None else rows[group.rank :: group.world_size]
    out = sft_step(engine, mine, micro_batch_tokens, SFT_LOSS.normaliser(rows))
    if group is not None:
        out = group.sum_metrics(out)
    seconds = time.perf_counter() - began
    tokens = sum(s.num_tokens for s in rows)
    return {
        "sft_loss": out["loss"],
        "lr": out["lr"],
        "grad_norm": out["grad_norm"],
        "rows": float(len(rows)),
        "tokens": float(tokens),
        "trained_tokens": out["trained_tokens"],
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "epoch": epoch,
    }


def _checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    root = run_dir / CHECKPOINTS
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def _save_checkpoint(
    engine: HFTrainEngine, run_dir: Path, step: int, keep: int, log_to: _RunLog | None, group: DataParallelGroup | None
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
    for old in _checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)


def _resume_step(cfg: SluiceConfig, run_dir: Path, engine: HFTrainEngine) -> int:
    """The step a ``run.resume`` continues from (0: a fresh run), its checkpoint loaded."""
    if cfg.run.resume is None:
        return 0
    if cfg.run.resume == "auto":
        found = _checkpoints(run_dir)
        if not found:
            return 0
        folder = found[-1]
    else:
        folder = Path(cfg.run.resume)
        if not (folder / STATE_FILE).is_file():
            raise ConfigError(f"run.resume: {folder} is not a complete sluice sft checkpoint (no {STATE_FILE})")
    engine.load(str(folder))
    state = json.loads((folder / STATE_FILE).read_text())
    if (run_dir / METRICS_LOG).is_file():
        truncate_log(run_dir / METRICS_LOG, int(state["metrics_bytes"]))  # records after the checkpoint go
    step = int(state["step"])
    log.info("sft: resumed from %s (step %d)", folder, step)
    return step

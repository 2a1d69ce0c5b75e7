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
(``controller/sft_eval.py``), ranks, the run log and checkpoints (``controller/supervised.py``, shared
with ``sluice rm``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.api import Sample
from sluice.config import SluiceConfig
from sluice.controller.sft_eval import SftEvaluation
from sluice.controller.supervised import (
    RunLog,
    context_length,
    leave_if_spawned,
    resume_step,
    run_ranks,
    run_steps,
)
from sluice.data import DatasetError, read_rows
from sluice.data.conversations import ConversationRenderer, ExampleSet
from sluice.engines.hf_model import load_tokenizer
from sluice.engines.hf_train import HFTrainEngine
from sluice.preflight import check_sft
from sluice.telemetry import TrainProgress
from sluice.trainer.data_parallel import DataParallelGroup
from sluice.trainer.sections import train_engine
from sluice.trainer.sft import SFT_LOSS, as_sample, batch_rows, sft_step, total_steps

log = logging.getLogger(__name__)


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
    limit = cfg.sft.max_length or context_length(model_dir)
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


def run_sft(cfg: SluiceConfig, progress: TrainProgress | None = None) -> SftResult:
    """The whole ``sluice sft`` run (see the module docstring): this process, plus
    ``resources.trainer.ranks - 1`` spawned ranks under ``trainer.strategy: ddp / fsdp2``."""
    check_sft(cfg)
    return run_ranks(cfg, _run_rank, progress, "sft")


def _run_rank(
    cfg: SluiceConfig, group_at: tuple[str, int] | None, progress: TrainProgress | None, rank: int
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
    resumed = resume_step(cfg, run_dir, engine, "sft")
    log_to = RunLog(cfg, run_dir, resumed, progress, steps, "sft_loss") if rank == 0 else None
    evaluation = SftEvaluation(cfg, data.val, data.tokenizer, model_dir, group)
    log.info("sft: %d rows (%d dropped), %d steps of %d rows, from step %d", n, data.filtered, steps, batch, resumed)

    def train_step(step: int) -> dict[str, float]:
        rows = [data.train[i] for i in batch_rows(n, batch, step, cfg.run.seed, limit)]
        return _train_step(engine, rows, cfg.trainer.micro_batch_tokens, (step + 1) * batch / n, group)

    evaluate = (lambda step: evaluation(engine, step)) if evaluation.enabled else None
    final, scores = run_steps(cfg, engine, data.tokenizer, (resumed, steps), train_step, evaluate, log_to, group)
    minutes = (time.monotonic() - started) / 60
    leave_if_spawned(rank)  # a spawned rank ends here, its process group still alive
    return SftResult(steps, minutes, final, scores.get("val_loss"), scores.get("accuracy"), data.filtered, resumed)


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

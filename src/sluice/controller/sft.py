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

Deliberately not here: the data-parallel strategies' ranks (``trainer.strategy: ddp / fsdp2``
are refused for now: one process), the step itself, row rendering.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.api import Sample
from sluice.config import ConfigError, SluiceConfig, dump_config
from sluice.controller.checkpoint import truncate_log
from sluice.data import DatasetError, PromptBuilder, read_rows
from sluice.data.conversations import ConversationRenderer, ExampleSet
from sluice.engines.hf_model import load_tokenizer
from sluice.engines.hf_train import HFTrainEngine
from sluice.preflight import check_sft, has_reward
from sluice.telemetry import TrainProgress
from sluice.telemetry.metrics import JsonlMetrics
from sluice.telemetry.plot import METRICS_LOG, plot_run
from sluice.telemetry.trackers import Trackers, open_trackers
from sluice.trainer.sections import train_engine
from sluice.trainer.sft import as_sample, batch_rows, mean_nll, sft_step, total_steps

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
        raise DatasetError(f"no training rows left: all {train.filtered['too_long']} are over sft.max_length ({limit})")
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


class SftEvaluation:
    """Validation loss, and greedy accuracy with a reward, of the engine's current weights."""

    def __init__(self, cfg: SluiceConfig, data: SftData, model_dir: str | Path) -> None:
        self.cfg, self.samples, self.model_dir = cfg, data.val, model_dir
        self.items: list[Any] = []
        self.tokenizer = data.tokenizer
        if has_reward(cfg) and cfg.data.val_files:
            from sluice.rewards import resolve_reward

            self.reward = resolve_reward(cfg.reward, None)
            builder = PromptBuilder(cfg.data, data.tokenizer)
            self.items = builder.read(cfg.data.val_files).items
        self._engine: Any = None

    @property
    def enabled(self) -> bool:
        return bool(self.samples or self.items) and self.cfg.run.eval_every > 0

    def __call__(self, engine: HFTrainEngine, step: int) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.samples:
            out["val_loss"] = mean_nll(engine, self.samples)
        if self.items:
            out.update(self._accuracy(engine, step))
        return out

    def _accuracy(self, engine: HFTrainEngine, step: int) -> dict[str, float]:
        from sluice.engines.hf_inference import HFInferenceEngine
        from sluice.engines.hf_model import load_causal_lm
        from sluice.rollout.evaluate import evaluate

        if self._engine is None:
            self._engine = HFInferenceEngine(load_causal_lm(self.model_dir), max_batch=self.cfg.rollout.max_batch)
        self._engine.update_weights(engine.export_weights(), step)
        max_new = self.cfg.rollout.max_new_tokens or 1
        result = evaluate(self._engine, self.items, self.tokenizer, self.reward, max_new, self.cfg.eval)
        return result.metrics()


def run_sft(cfg: SluiceConfig, progress: TrainProgress | None = None) -> SftResult:
    """The whole ``sluice sft`` run (see the module docstring)."""
    check_sft(cfg)
    started = time.monotonic()
    torch.set_num_threads(cfg.run.threads or torch.get_num_threads())
    torch.manual_seed(cfg.run.seed)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    model_dir = cfg.model.path or ""
    data = load_sft_data(cfg, model_dir)
    n, batch = len(data.train), cfg.sft.batch_size
    steps = total_steps(n, batch, cfg.sft.epochs, cfg.sft.steps)
    limit = None if cfg.sft.steps is not None else round(cfg.sft.epochs * n)
    if progress is not None:
        progress.set_total(steps)
    engine = train_engine(model_dir, cfg.trainer, 1.0, steps)
    resumed = _resume_step(cfg, run_dir, engine)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    metrics = JsonlMetrics(run_dir / METRICS_LOG, append=resumed > 0)
    trackers = open_trackers(cfg.tracking, run_dir, cfg.model_dump(), resume=resumed > 0)
    evaluation = SftEvaluation(cfg, data, model_dir)
    scores: dict[str, float] = {}
    log.info("sft: %d rows (%d dropped), %d steps of %d rows, from step %d", n, data.filtered, steps, batch, resumed)
    if resumed == 0 and evaluation.enabled:
        scores = _log(metrics, trackers, "eval", 0, evaluation(engine, 0))
    failed = True
    try:
        for step in range(resumed, steps):
            rows = [data.train[i] for i in batch_rows(n, batch, step, cfg.run.seed, limit)]
            record = _train_step(engine, rows, cfg.trainer.micro_batch_tokens, (step + 1) * batch / n)
            _log(metrics, trackers, "train", step + 1, record)
            if evaluation.enabled and ((step + 1) % cfg.run.eval_every == 0 or step + 1 == steps):
                scores = _log(metrics, trackers, "eval", step + 1, evaluation(engine, step + 1))
            if progress is not None:
                progress.update(step + 1, loss=record["sft_loss"], val_loss=scores.get("val_loss"))
            if cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0 and step + 1 < steps:
                _save_checkpoint(engine, run_dir, step + 1, cfg.run.keep_checkpoints, metrics)
        final = run_dir / FINAL_MODEL
        engine.save(str(final), optimizer=False)
        data.tokenizer.save_pretrained(final)
        failed = False
    finally:
        trackers.close(failed)
    if cfg.tracking.plot:
        plot_run(run_dir)
    minutes = (time.monotonic() - started) / 60
    return SftResult(steps, minutes, final, scores.get("val_loss"), scores.get("accuracy"), data.filtered)


def _train_step(engine: HFTrainEngine, rows: list[Sample], micro_batch_tokens: int, epoch: float) -> dict[str, float]:
    began = time.perf_counter()
    out = sft_step(engine, rows, micro_batch_tokens)
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


def _log(metrics: JsonlMetrics, trackers: Trackers, kind: str, step: int, values: dict[str, float]) -> dict[str, float]:
    record = metrics.log(kind, step=step, **values)
    trackers.log_record(kind, step, record)
    return values


def _checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    root = run_dir / CHECKPOINTS
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def _save_checkpoint(engine: HFTrainEngine, run_dir: Path, step: int, keep: int, metrics: JsonlMetrics) -> None:
    """Weights, optimizer and LR schedule, then the state file (last: the folder is complete)
    with the length ``metrics.jsonl`` had, which a resume cuts it back to."""
    folder = run_dir / CHECKPOINTS / f"step_{step:06d}"
    shutil.rmtree(folder, ignore_errors=True)
    engine.save(str(folder))
    size = metrics.path.stat().st_size if metrics.path is not None else 0
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

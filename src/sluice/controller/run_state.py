"""The typed run object: what one training run knows besides its workers, built once by ``fit``.

``TrainingRun`` holds the resolved config, the run's folder and logs, the prompt stream and the
held-out set, the checkpoint store and (with ``run.resume``) the state being continued, and it
logs what the loop reports (steps, evaluations, a few decoded samples) to ``metrics.jsonl``,
``samples.jsonl`` and the trackers of ``tracking.trackers`` (``telemetry/trackers.py``). The loop
(``controller/training.py``) and the checkpoint code (``controller/resume.py``) read and update it
through these fields and methods; nothing assigns new attributes onto it and nothing reaches into
``sluice.RLTrainer``.

Deliberately not here: workers, engines, scheduling (the controller), file layouts
(``controller/checkpoint.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from sluice.api import PromptItem
from sluice.config import SluiceConfig
from sluice.controller.checkpoint import CheckpointStore
from sluice.data import PromptStream
from sluice.rollout.evaluate import EvalResult
from sluice.telemetry import JsonlMetrics, TrainProgress
from sluice.telemetry.samples import SampleSummary, TokenDecoder, sample_rows
from sluice.telemetry.trackers import Trackers, open_trackers

METRICS_LOG = "metrics.jsonl"
TRAINED_IDS_LOG = "trained_ids.jsonl"
SAMPLES_LOG = "samples.jsonl"
LOGS = (METRICS_LOG, TRAINED_IDS_LOG, SAMPLES_LOG)


@dataclass
class TrainingRun:
    """One run's config, data, logs and progress (the workers live in the pipeline)."""

    config: SluiceConfig
    run_dir: Path
    prompts: PromptStream
    eval_items: list[PromptItem]
    max_new_tokens: int
    """The response cap of evaluation (and of rollout, which the pipeline already has)."""
    checkpoints: CheckpointStore
    resumed_from: Path | None = None
    """The checkpoint folder this run continues (``run.resume``), else ``None``."""
    tokenizer: TokenDecoder | None = None
    """Decodes the samples of ``samples.jsonl`` (``tracking.samples_every``)."""
    progress: TrainProgress = field(default_factory=lambda: TrainProgress(0, enabled=False))
    metrics: JsonlMetrics = field(default_factory=lambda: JsonlMetrics(None))
    trained_ids_log: JsonlMetrics = field(default_factory=lambda: JsonlMetrics(None))
    """One record per step: the ids (``Sample.uid``) of the samples it trained."""
    samples_log: JsonlMetrics = field(default_factory=lambda: JsonlMetrics(None))
    """Every ``tracking.samples_every`` steps, a few of the step's trained samples as text."""
    trackers: Trackers = field(default_factory=Trackers)
    version: int = 0
    rollout_replicas: int | None = None
    """The rollout's replicas after the last rebalancing decision (``fleet.rebalance``; kept in
    checkpoints), ``None`` while the config's count holds."""
    base_eval: EvalResult | None = None
    loop_seconds: float = 0.0
    """The training loop alone (what throughput is measured over)."""
    started: float = field(default_factory=time.monotonic)
    _last_step_at: float = field(default_factory=time.monotonic)
    _last_accuracy: float | None = None

    def open_logs(self, *, append: bool) -> None:
        """Start (or, resuming, continue) the run's JSONL logs in ``run_dir`` and its trackers."""
        self.metrics = JsonlMetrics(self.run_dir / METRICS_LOG, append=append)
        self.trained_ids_log = JsonlMetrics(self.run_dir / TRAINED_IDS_LOG, append=append)
        self.samples_log = JsonlMetrics(self.run_dir / SAMPLES_LOG, append=append)
        dump = self.config.model_dump(mode="json")
        self.trackers = open_trackers(self.config.tracking, self.run_dir, dump, resume=append)

    def close_logs(self, *, failed: bool = False) -> None:
        """End the trackers' runs (wandb's is marked failed when the run raised)."""
        self.trackers.close(failed)

    @property
    def final_model_dir(self) -> Path:
        return self.run_dir / "final_model"

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates at all: ``run.eval_every > 0`` and a non-empty evaluation set."""
        return bool(self.config.run.eval_every) and bool(self.eval_items)

    def eval_due(self, version: int) -> bool:
        """A periodic evaluation after step ``version`` (the last step's is the final evaluation)."""
        cfg = self.config.run
        return self.evaluates and version % cfg.eval_every == 0 and version < cfg.steps

    def checkpoint_due(self, version: int) -> bool:
        every = self.config.run.checkpoint_every
        return bool(every) and version % every == 0

    def samples_due(self, version: int) -> bool:
        every = self.config.tracking.samples_every
        return bool(every) and version % every == 0

    def log_eval(self, result: EvalResult, step: int | None = None) -> EvalResult:
        """An ``eval`` record: overall, per-source and per-bucket scores (``EvalResult.metrics``)."""
        self._last_accuracy = result.accuracy
        step = self.version if step is None else step
        record = self.metrics.log("eval", step=step, **result.metrics())
        self.trackers.log_record("eval", step, record)
        return result

    def log_samples(self, version: int, summaries: list[SampleSummary]) -> None:
        """Step ``version``'s chosen samples, decoded, to ``samples.jsonl`` and the trackers."""
        assert self.tokenizer is not None, "TrainingRun.tokenizer decodes the samples"
        rows = [self.samples_log.log("sample", **row) for row in sample_rows(version, summaries, self.tokenizer)]
        self.trackers.log_samples(version, rows)

    def log_step(self, version: int, stats: dict[str, float], metrics: dict[str, float]) -> bool:
        """Log one step (after any due evaluation); False stops the run (``run.max_minutes``)."""
        self.version = version
        now = time.monotonic()
        step_s = now - self._last_step_at
        record = {**stats, **metrics, "step_s": step_s, "tokens_per_s": stats["trained_tokens"] / max(step_s, 1e-9)}
        self._last_step_at = time.monotonic()
        logged = self.metrics.log("train", step=version, **record)
        self.trackers.log_record("train", version, logged)
        self.progress.update(
            version, reward=record["reward_mean"], acc=self._last_accuracy, tok_s=record["tokens_per_s"]
        )
        limit = self.config.run.max_minutes
        return limit is None or now - self.started <= 60 * limit

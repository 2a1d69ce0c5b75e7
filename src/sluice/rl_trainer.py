"""``sluice.RLTrainer``: the user-level API (AsyncFlow §5.1) and the composition root of a run.

It wires config → task → engines → workflow → trainer and exposes AsyncFlow's verbs
(``init_engines``, ``load_prompt_data``, ``send_experience_data``, ``recv_experience_data``,
``sync_actor_model``, ``fit``). The loop itself lives in ``controller/``; the numerics live in
``engines/`` and ``trainer/``. The CLI is a thin shell over this class.

    from sluice import RLTrainer
    from sluice.config import load_config

    trainer = RLTrainer(load_config(None, ["run.steps=50"]))
    result = trainer.fit()
    print(result.base_accuracy, "->", result.final_accuracy)
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.api import PromptItem, RewardFn, Sample, SamplingParams
from sluice.config import ConfigError, SluiceConfig, dump_config
from sluice.controller.sync_loop import run_sync
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm, load_tokenizer
from sluice.engines.hf_train import HFTrainEngine
from sluice.rollout.evaluate import EvalResult, evaluate
from sluice.rollout.single_turn import SingleTurnWorkflow, group_stats
from sluice.tasks import TASKS
from sluice.tasks.base_model import ensure_base_model
from sluice.tasks.dataset import PromptStream, read_jsonl, to_prompt_items
from sluice.tasks.spec import TaskSpec, eval_rows, generate_rows
from sluice.telemetry import JsonlMetrics, TrainProgress
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.step import plan_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FitResult:
    base_accuracy: float
    final_accuracy: float
    steps: int
    minutes: float
    run_dir: Path
    final_model_dir: Path


class RLTrainer:
    """One RL run: ``RLTrainer(config).fit()``; or call the verbs one by one."""

    def __init__(self, config: SluiceConfig, *, reward: RewardFn | None = None) -> None:
        if config.task.name not in TASKS:
            raise ConfigError(f"task.name: unknown task {config.task.name!r} (built-in: {', '.join(TASKS)})")
        self.config = config
        self.task: TaskSpec = TASKS[config.task.name]
        self.reward: RewardFn = reward or self.task.reward
        self.run_dir = Path(config.run.output_dir) / config.run.name
        self.metrics = JsonlMetrics(None)
        self.version = 0
        self.model_dir: Path | None = None
        self._buffer: list[Sample] = []
        self._next_group = 0
        self._engines_ready = False
        self._data_ready = False
        torch.set_num_threads(config.run.threads or os.cpu_count() or 1)
        torch.manual_seed(config.run.seed)

    # -- AsyncFlow user-level API -------------------------------------------------------------

    def init_engines(
        self, on_sft_step: Callable[[int, float], None] | None = None, *, train: bool = True
    ) -> None:
        """Resolve the model (building the embedded default if ``model.path`` is null) and load
        one inference engine and, unless ``train`` is False, one train engine from it."""
        cfg = self.config
        if cfg.model.path is None:
            self.model_dir = ensure_base_model(
                self.task, cfg.model.cache_dir, cfg.run.seed, cfg.task.eval_prompts, on_step=on_sft_step
            )
        else:
            self.model_dir = Path(cfg.model.path)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.engine = HFInferenceEngine(load_causal_lm(self.model_dir), max_batch=cfg.rollout.max_batch)
        self.train_engine = (
            None
            if not train
            else HFTrainEngine(
                load_causal_lm(self.model_dir),
                lr=cfg.trainer.lr,
                betas=cfg.trainer.betas,
                weight_decay=cfg.trainer.weight_decay,
                grad_clip=cfg.trainer.grad_clip,
                temperature=cfg.rollout.temperature,
            )
        )
        self.algorithm = GRPOAlgorithm(
            estimator=cfg.trainer.algorithm, clip_low=cfg.trainer.clip_low, clip_high=cfg.trainer.clip_high
        )
        params = SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            stop_token_ids=(self.tokenizer.eos_token_id,),
        )
        self.workflow = SingleTurnWorkflow(self.tokenizer, params, cfg.rollout.group_size, cfg.run.seed)
        self._engines_ready = True

    def load_prompt_data(self, rows: Iterable[dict[str, Any]] | None = None) -> None:
        """Validate the training prompts (``rows``, ``task.data_path``, or the task's generator)
        and the fixed held-out set; training prompts that appear in the held-out set are an error."""
        self._require_engines()
        cfg = self.config.task
        held_out_rows = eval_rows(self.task, cfg.eval_prompts)
        self.eval_items = to_prompt_items(held_out_rows, self.tokenizer, source="held-out row")
        held_out = {row["prompt"] for row in held_out_rows}
        source = "row"
        if rows is None and cfg.data_path is not None:
            rows, source = read_jsonl(cfg.data_path), f"{cfg.data_path} row"
        if rows is None:
            rows = generate_rows(self.task, cfg.train_prompts, self.config.run.seed + 1, exclude=held_out)
        items = to_prompt_items(list(rows), self.tokenizer, source=source)
        leaked = [it.index for it in items if it.prompt in held_out]
        if leaked:
            raise ValueError(f"{source} {leaked[0]}: prompt is in the held-out set ({len(leaked)} such rows)")
        self.prompts = PromptStream(items, self.config.run.seed)
        self._data_ready = True

    def send_experience_data(self, samples: Sequence[Sample]) -> None:
        """Hand scored samples to the trainer's side (in-process buffer in ``mode: sync``)."""
        self._buffer.extend(samples)

    def recv_experience_data(self, num_groups: int) -> list[Sample]:
        """Take the ``num_groups`` oldest complete groups from the buffer (a global batch)."""
        order: list[int] = []
        for s in self._buffer:
            if s.group_id not in order:
                order.append(s.group_id)
        chosen = set(order[:num_groups])
        batch = [s for s in self._buffer if s.group_id in chosen]
        self._buffer = [s for s in self._buffer if s.group_id not in chosen]
        return batch

    def sync_actor_model(self) -> None:
        """Push the trainer's weights to the inference engine, tagged with the current version."""
        self.engine.update_weights(self.train_engine.export_weights(), self.version)

    # -- loop steps (driven by controller.sync_loop) --------------------------------------------

    def admit(self, num_groups: int) -> list[tuple[PromptItem, int]]:
        self._require_data()
        groups = []
        for item in self.prompts.take(num_groups):
            groups.append((item, self._next_group))
            self._next_group += 1
        return groups

    def generate(self, groups: Sequence[tuple[PromptItem, int]]) -> list[Sample]:
        async def _all() -> list[list[Sample]]:
            runs = (self.workflow.run(item, gid, self.engine, self.reward) for item, gid in groups)
            return await asyncio.gather(*runs)

        return [s for group in asyncio.run(_all()) for s in group]

    def train(self, samples: Sequence[Sample]) -> dict[str, float]:
        plan = plan_step(samples, self.algorithm, self.config.trainer.micro_batch_tokens)
        metrics = self.train_engine.train_step(plan, self.algorithm)
        self.version += 1
        return metrics

    def evaluate(self) -> EvalResult:
        """Greedy accuracy of the inference engine's current weights on the held-out set."""
        self._require_data()
        return evaluate(self.engine, self.eval_items, self.tokenizer, self.reward, self.max_new_tokens)

    @property
    def max_new_tokens(self) -> int:
        return self.config.rollout.max_new_tokens or self.task.max_new_tokens

    def fit(self, progress: TrainProgress | None = None) -> FitResult:
        """Run the whole training: base eval, the loop, final eval, save the final model."""
        cfg = self.config
        if not self._engines_ready:
            self.init_engines()
        if not self._data_ready:
            self.load_prompt_data()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        self.metrics = JsonlMetrics(self.run_dir / "metrics.jsonl")
        base = self.evaluate()
        self.metrics.log("eval", step=self.version, accuracy=base.accuracy, **_prefixed(base.by_bucket))
        started = time.monotonic()
        bar = progress or TrainProgress(cfg.run.steps, enabled=False)
        last_acc = base.accuracy
        timer = {"t": time.monotonic()}

        def after_step(version: int, batch: list[Sample], metrics: dict[str, float]) -> bool:
            nonlocal last_acc
            now = time.monotonic()
            stats = group_stats(batch)
            tokens = sum(len(s.response_ids) for s in batch)
            record = {
                **stats,
                **metrics,
                "step_s": now - timer["t"],
                "tokens_per_s": tokens / (now - timer["t"]),
            }
            timer["t"] = now
            if cfg.run.eval_every and version % cfg.run.eval_every == 0 and version < cfg.run.steps:
                result = self.evaluate()
                last_acc = result.accuracy
                self.metrics.log(
                    "eval", step=version, accuracy=result.accuracy, **_prefixed(result.by_bucket)
                )
                timer["t"] = time.monotonic()
            self.metrics.log("train", step=version, **record)
            bar.update(version, reward=stats["reward_mean"], acc=last_acc, tok_s=record["tokens_per_s"])
            out_of_time = cfg.run.max_minutes is not None and now - started > 60 * cfg.run.max_minutes
            return not out_of_time

        run_sync(self, cfg.run.steps, cfg.rollout.prompts_per_step, after_step)
        minutes = (time.monotonic() - started) / 60
        final = self.evaluate()
        self.metrics.log("eval", step=self.version, accuracy=final.accuracy, **_prefixed(final.by_bucket))
        final_dir = self.run_dir / "final_model"
        self.train_engine.save(str(final_dir))
        self.tokenizer.save_pretrained(final_dir)
        return FitResult(base.accuracy, final.accuracy, self.version, minutes, self.run_dir, final_dir)

    def _require_engines(self) -> None:
        if not self._engines_ready:
            raise RuntimeError("call init_engines() first")

    def _require_data(self) -> None:
        if not self._data_ready:
            raise RuntimeError("call load_prompt_data() first")


def _prefixed(by_bucket: dict[str, float]) -> dict[str, float]:
    return {f"accuracy_{k}": v for k, v in by_bucket.items()}

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
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.api import PromptItem, RewardFn, Sample, SamplingParams
from sluice.config import ConfigError, SluiceConfig, dump_config
from sluice.config.agentic import check_agentic
from sluice.controller.resume import DriverState, checkpoint_due, open_run, restore_sync, save_sync_checkpoint
from sluice.controller.sync_loop import run_sync
from sluice.engines.critic import CriticEngine
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm, load_tokenizer
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.lora import LoraSpec
from sluice.pipeline.chain import ColocatedChain
from sluice.pipeline.model_nodes import ModelBindings
from sluice.pipeline.run_dag import plan_for_run
from sluice.rewards import build_reward_service
from sluice.rollout.evaluate import EvalResult, evaluate
from sluice.rollout.filters import reward_failure
from sluice.rollout.single_turn import SingleTurnWorkflow, group_stats
from sluice.tasks import TASKS
from sluice.tasks.base_model import ensure_base_model
from sluice.tasks.dataset import DatasetError, PromptStream, read_jsonl, to_prompt_items
from sluice.tasks.spec import TaskSpec, eval_rows, generate_rows
from sluice.telemetry import JsonlMetrics, SpanRecorder, TrainProgress, write_chrome_trace
from sluice.telemetry.cpu import CpuMeter
from sluice.telemetry.trace import trace_numbers
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.ppo import CriticSpec
from sluice.trainer.reference import frozen_engine
from sluice.trainer.updates import UpdateSchedule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FitResult:
    base_accuracy: float
    final_accuracy: float
    steps: int
    minutes: float
    """The whole ``fit``, evaluations included."""
    loop_seconds: float
    """The training loop alone (what throughput is measured over)."""
    run_dir: Path
    final_model_dir: Path


class RLTrainer:
    """One RL run: ``RLTrainer(config).fit()``; or call the verbs one by one."""

    def __init__(self, config: SluiceConfig, *, reward: RewardFn | None = None) -> None:
        if config.task.name not in TASKS:
            raise ConfigError(f"task.name: unknown task {config.task.name!r} (built-in: {', '.join(TASKS)})")
        self.config = config
        self.task: TaskSpec = TASKS[config.task.name]
        check_agentic(config, self.task.env)
        self.reward: RewardFn = reward or self.task.reward
        self.run_dir = Path(config.run.output_dir) / config.run.name
        self.metrics = JsonlMetrics(None)
        self.trained_ids_log = JsonlMetrics(None)
        """One record per step: the ids (``Sample.uid``) of the samples it trained."""
        self.resumed: DriverState | None = None
        self.base_eval: EvalResult | None = None
        self.version = 0
        self.model_dir: Path | None = None
        self._buffer: list[Sample] = []
        self._next_group = 0
        self._trained_groups = 0
        self.discards: Counter[str] = Counter()
        """``run.mode: sync``: samples of groups dropped because a reward failed, per reason."""
        self._engines_ready = False
        self._data_ready = False
        self.loop_seconds = 0.0
        self.last_sync_s = 0.0
        self.rollout_tracer = SpanRecorder("rollout", enabled=config.run.trace)
        self.trainer_tracer = SpanRecorder("trainer", enabled=config.run.trace)
        torch.set_num_threads(config.run.threads or os.cpu_count() or 1)
        torch.manual_seed(config.run.seed)

    # -- AsyncFlow user-level API -------------------------------------------------------------

    def init_engines(self, on_sft_step: Callable[[int, float], None] | None = None, *, train: bool = True) -> None:
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
        in_process = cfg.run.mode == "sync" or not train
        if in_process:
            self.engine = HFInferenceEngine(load_causal_lm(self.model_dir), max_batch=cfg.rollout.max_batch)
            self.reward_service = build_reward_service(cfg.reward, self.reward)
        if in_process and train:
            self.train_engine = HFTrainEngine(load_causal_lm(self.model_dir), **self.train_engine_kwargs)
        self.algorithm = GRPOAlgorithm(
            estimator="gae" if cfg.trainer.algorithm == "ppo" else cfg.trainer.algorithm,
            clip_low=cfg.trainer.clip_low,
            clip_high=cfg.trainer.clip_high,
            policy_loss=cfg.trainer.policy_loss,
            loss_agg_mode=cfg.trainer.loss_agg_mode,
            dual_clip_c=cfg.trainer.dual_clip_c,
            behav_weight_cap=cfg.trainer.tis_cap,
            tis_mode=cfg.trainer.tis_mode,
            tis_level=cfg.trainer.tis_level,
            kl_coef=cfg.trainer.kl_coef,
            kl_estimator=cfg.trainer.kl_estimator,
            kl_in=cfg.trainer.kl_in,
            entropy_coef=cfg.trainer.entropy_coef,
        )
        t = cfg.trainer
        self.critic_spec: CriticSpec | None = None
        """PPO's critic (``mode: async`` builds it in the trainer and the critic-values worker)."""
        if t.algorithm == "ppo":
            self.critic_spec = CriticSpec(
                t.critic_lr, t.value_clip, t.grad_clip, t.micro_batch_tokens, t.gae_gamma, t.gae_lambda
            )
        self.critic: CriticEngine | None = None
        if in_process and train and self.critic_spec is not None:
            self.critic = self.critic_spec.engine(self.model_dir)
        if in_process and train and self.algorithm.uses_reference:
            self.reference_engine = frozen_engine(self.model_dir, self.train_engine_kwargs)
        self.update_schedule = UpdateSchedule(
            cfg.trainer.ppo_mini_batches, cfg.trainer.ppo_epochs, cfg.trainer.prox_logprobs == "recompute"
        )
        self.params = SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            stop_token_ids=(self.tokenizer.eos_token_id,),
        )
        self.workflow = SingleTurnWorkflow(self.tokenizer, self.params, cfg.rollout.group_size, cfg.run.seed)
        self.dag_plan = plan_for_run(cfg)
        if in_process and train:  # every model of the step in this process: the DAG runs as one chain
            self.dag_chain = ColocatedChain(self.dag_plan, self._model_bindings())
        self._engines_ready = True

    def _model_bindings(self) -> ModelBindings:
        t = self.config.trainer
        return ModelBindings(
            algorithm=self.algorithm,
            micro_batch_tokens=t.micro_batch_tokens,
            schedule=self.update_schedule,
            temperature=self.train_engine.temperature,
            actor=self.train_engine,
            reference=getattr(self, "reference_engine", None),
            critic=self.critic,
            gae_gamma=t.gae_gamma,
            gae_lambda=t.gae_lambda,
            generate=self.generate,
        )

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
            raise DatasetError(f"{source} {leaked[0]}: prompt is in the held-out set ({len(leaked)} such rows)")
        self.prompts = PromptStream(items, self.config.run.seed)
        self._data_ready = True

    def send_experience_data(self, samples: Sequence[Sample]) -> None:
        """Hand scored samples to the trainer's side (in-process buffer in ``mode: sync``)."""
        self._require_sync("send_experience_data")
        self._buffer.extend(samples)

    def recv_experience_data(self, num_groups: int) -> list[Sample]:
        """Take the ``num_groups`` oldest complete groups from the buffer (a global batch)."""
        self._require_sync("recv_experience_data")
        order = list(dict.fromkeys(s.group_id for s in self._buffer))  # arrival order, unique
        chosen = set(order[:num_groups])
        batch = [s for s in self._buffer if s.group_id in chosen]
        self._trained_groups += len(chosen)
        self._buffer = [s for s in self._buffer if s.group_id not in chosen]
        return batch

    def sync_actor_model(self) -> None:
        """Push the trainer's weights to the inference engine, tagged with the current version."""
        self._require_sync("sync_actor_model")
        started = time.monotonic()
        with self.rollout_tracer.span("weight_sync", lane="weights", version=self.version):
            self.engine.update_weights(self.train_engine.export_weights(), self.version)
        self.last_sync_s = time.monotonic() - started  # fully exposed: nothing else runs meanwhile

    # -- loop steps (driven by controller.sync_loop) --------------------------------------------

    def admit(self, num_groups: int) -> list[tuple[PromptItem, int]]:
        self._require_data()
        groups = []
        for item in self.prompts.take(num_groups):
            groups.append((item, self._next_group))
            self._next_group += 1
        return groups

    def generate(self, groups: Sequence[tuple[PromptItem, int]]) -> list[Sample]:
        """Generate and score ``groups``; a group whose reward failed is dropped and counted."""

        async def _all() -> list[list[Sample]]:
            runs = (self.workflow.run(item, gid, self.engine, self.reward_service) for item, gid in groups)
            return await asyncio.gather(*runs)

        with self.rollout_tracer.span("generate", lane="engine", groups=len(groups)):
            scored = asyncio.run(_all())
        kept = []
        for group in scored:
            reason = reward_failure(group)
            if reason is None:
                kept.extend(group)
            else:
                self.discards[reason] += len(group)
        return kept

    def train(self, samples: Sequence[Sample]) -> dict[str, float]:
        with self.trainer_tracer.span("train_step", lane="trainer", samples=len(samples)):
            # the run's DAG after generation (reference, critic, advantages, updates), in order
            metrics = self.dag_chain.run(samples, self.config.rollout.group_size, self.version)
        self.version += 1
        return metrics

    def evaluate(self) -> EvalResult:
        """Greedy accuracy of the inference engine's current weights on the held-out set."""
        self._require_data()
        return evaluate(self.engine, self.eval_items, self.tokenizer, self.reward_service, self.max_new_tokens)

    @property
    def train_engine_kwargs(self) -> dict[str, Any]:
        t = self.config.trainer
        return {
            "lr": t.lr,
            "betas": t.betas,
            "weight_decay": t.weight_decay,
            "grad_clip": t.grad_clip,
            "temperature": self.config.rollout.temperature,
            "layout": t.layout,
            "share_prompts": t.share_prompts,
            "pack_row_tokens": t.pack_row_tokens,
            "lora": LoraSpec(t.lora_rank, t.lora_alpha, t.lora_targets) if t.lora_rank else None,
        }

    @property
    def max_new_tokens(self) -> int:
        return self.config.rollout.max_new_tokens or self.task.max_new_tokens

    def fit(self, progress: TrainProgress | None = None) -> FitResult:
        """Run the whole training (``run.mode``: sync or async): base eval, the loop, final
        eval, the final model saved as an HF folder, metrics and (async) the timeline trace."""
        cfg = self.config
        if not self._engines_ready:
            self.init_engines()
        if not self._data_ready:
            self.load_prompt_data()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.resumed = open_run(self)  # the logs, and the checkpoint's state with run.resume
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        self._progress = progress or TrainProgress(cfg.run.steps, enabled=False)
        self._last_acc: float | None = None
        self._started = self._last_step_at = time.monotonic()
        if cfg.run.mode == "sync":
            base, final = self._fit_sync()
        else:
            from sluice.controller.async_run import run_async_training

            base, final = asyncio.run(run_async_training(self))
        self.tokenizer.save_pretrained(self.final_model_dir)
        minutes = (time.monotonic() - self._started) / 60
        return FitResult(
            base.accuracy, final.accuracy, self.version, minutes, self.loop_seconds, self.run_dir, self.final_model_dir
        )

    @property
    def final_model_dir(self) -> Path:
        return self.run_dir / "final_model"

    def _fit_sync(self) -> tuple[EvalResult, EvalResult]:
        base = self.log_eval(self.evaluate()) if self.resumed is None else restore_sync(self, self.resumed)
        self.base_eval = base

        def after_step(version: int, batch: list[Sample], metrics: dict[str, float]) -> bool:
            self.trained_ids_log.log("trained", step=version, ids=[s.uid for s in batch])
            stats = {
                **group_stats(batch),
                "trained_tokens": float(sum(len(s.response_ids) for s in batch)),
                "weight_sync_s": self.last_sync_s,
                "exposed_weight_sync_s": self.last_sync_s,
            }
            if self.eval_due(version):
                self.log_eval(self.evaluate(), version)
            keep_going = self.after_step(version, stats, metrics)
            if checkpoint_due(self, version):
                save_sync_checkpoint(self, version)
            return keep_going

        self.rollout_tracer.drain()  # the trace covers the loop only
        self.trainer_tracer.drain()
        cpu, started = CpuMeter(), time.monotonic()  # the /proc scan outside the timed loop
        run_sync(self, self.config.run.steps, self.config.rollout.prompts_per_step, after_step)
        self.loop_seconds = time.monotonic() - started
        self.metrics.log("cpu", **cpu.read())  # CPU seconds in the loop: this process, its reward pool
        groups = self._trained_groups
        discards = {f"discarded_{reason}": float(n) for reason, n in self.discards.items()}
        self.metrics.log("fates", groups_trained=groups, staleness_0=groups, **discards)  # sync: all on-policy
        self.metrics.log("rewards", **self.reward_service.stats())
        if self.config.run.trace:
            events = self.rollout_tracer.drain() + self.trainer_tracer.drain()
            write_chrome_trace(self.run_dir / "trace.json", [events])
            self.metrics.log("trace", **trace_numbers(events))
        final = self.log_eval(self.evaluate())
        self.reward_service.close()
        self.train_engine.save(str(self.final_model_dir))
        return base, final

    def eval_due(self, version: int) -> bool:
        cfg = self.config.run
        return bool(cfg.eval_every) and version % cfg.eval_every == 0 and version < cfg.steps

    def after_step(self, version: int, stats: dict[str, float], metrics: dict[str, float]) -> bool:
        """Log one step (after any due evaluation); False stops the run (``run.max_minutes``)."""
        cfg = self.config.run
        now = time.monotonic()
        step_s = now - self._last_step_at
        tokens_per_s = stats["trained_tokens"] / max(step_s, 1e-9)
        record = {**stats, **metrics, "step_s": step_s, "tokens_per_s": tokens_per_s}
        self._last_step_at = time.monotonic()
        self.metrics.log("train", step=version, **record)
        self._progress.update(version, reward=record["reward_mean"], acc=self._last_acc, tok_s=record["tokens_per_s"])
        return cfg.max_minutes is None or now - self._started <= 60 * cfg.max_minutes

    def log_eval(self, result: EvalResult, step: int | None = None) -> EvalResult:
        self._last_acc = result.accuracy
        by_bucket = {f"accuracy_{k}": v for k, v in result.by_bucket.items()}
        self.metrics.log("eval", step=self.version if step is None else step, accuracy=result.accuracy, **by_bucket)
        return result

    def _require_sync(self, verb: str) -> None:
        if self.config.run.mode != "sync":
            raise RuntimeError(
                f"{verb}() drives the in-process loop of run.mode=sync; in run.mode=async, fit() runs the "
                "pipeline's workers and moves experience and weights itself"
            )

    def _require_engines(self) -> None:
        if not self._engines_ready:
            raise RuntimeError("call init_engines() first")

    def _require_data(self) -> None:
        if not self._data_ready:
            raise RuntimeError("call load_prompt_data() first")

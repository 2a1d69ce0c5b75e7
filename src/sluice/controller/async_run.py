"""A whole asynchronous training run: build the pipeline, evaluate, run the controller, collect.

Glue between ``sluice.RLTrainer`` (config, task, data, logging) and the asynchronous loop: it
places the workers (``controller/pipelines.py``), runs the base and final evaluations on the
rollout engine, turns group reports into per-step statistics, saves the final model and writes
the timeline (``trace.json``) and the sample-fate counters. It adds no scheduling logic.
"""

from __future__ import annotations

import time
from typing import Any

from sluice.controller.async_loop import AsyncController
from sluice.controller.ledger import GroupLedger
from sluice.controller.pipelines import LocalPipeline, PipelineSpec
from sluice.controller.ray_pipeline import RayPipeline
from sluice.controller.resume import checkpoint_due, restore_async, resume_controller, save_async_checkpoint
from sluice.controller.staleness import StalenessGate
from sluice.pipeline.run_dag import async_queue_tasks
from sluice.rollout.agentic import env_rollout_spec
from sluice.rollout.evaluate import EvalResult
from sluice.rollout.filters import FILTERS
from sluice.telemetry.cpu import CpuMeter
from sluice.telemetry.trace import trace_numbers, write_chrome_trace
from sluice.trainer.critic_task import CRITIC_TASK
from sluice.trainer.reference import REF_TASK
from sluice.trainer.worker import TRAIN_TASK

ENGINE_SYNC_STATS = (
    "weight_updates",
    "weight_updates_superseded",
    "weight_drain_s",
    "reprefill_tokens",
    "steps",
    "generated_tokens",
    "drive_s",
    "proxy_routed",
    "proxy_rerouted",
)


def pipeline_spec(trainer: Any) -> PipelineSpec:
    cfg = trainer.config
    return PipelineSpec(
        model_dir=trainer.model_dir,
        reward=trainer.reward,
        params=trainer.params,
        group_size=cfg.rollout.group_size,
        run_seed=cfg.run.seed,
        max_batch=cfg.rollout.max_batch,
        algorithm=trainer.algorithm,
        engine_kwargs=trainer.train_engine_kwargs,
        micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        update_schedule=trainer.update_schedule,
        weight_update=cfg.rollout.weight_update,
        group_filter=FILTERS[cfg.rollout.filter_groups],
        reward_config=cfg.reward,
        rollout_threads=cfg.run.rollout_threads,
        trainer_threads=cfg.run.trainer_threads,
        data_parallel=cfg.trainer.data_parallel,
        trace=cfg.run.trace,
        replicas=cfg.rollout.replicas,
        prompt_replication=cfg.rollout.prompt_replication,
        stagger=cfg.rollout.stagger,
        scheduling=cfg.rollout.scheduling,
        engine=cfg.rollout.engine,
        engine_options=cfg.engine_options(),
        fleet=cfg.fleet,
        tasks=async_queue_tasks(trainer.dag_plan, TRAIN_TASK, REF_TASK, CRITIC_TASK),
        agentic=env_rollout_spec(cfg.agentic, trainer.task.env, trainer.max_new_tokens),
        critic=trainer.critic_spec,
    )


async def run_async_training(trainer: Any) -> tuple[EvalResult, EvalResult]:
    """``trainer`` is a ``sluice.RLTrainer`` with engines resolved and prompts loaded."""
    cfg = trainer.config
    spec = pipeline_spec(trainer)
    if cfg.run.backend == "ray":
        pipeline: LocalPipeline | RayPipeline = RayPipeline(spec, trainer.prompts, cfg.run.ray_address)
    else:
        pipeline = LocalPipeline(spec, trainer.prompts)
    trainer.pipeline = pipeline
    max_new = trainer.max_new_tokens
    try:
        if trainer.resumed is None:
            base = trainer.log_eval(await pipeline.evaluate(trainer.eval_items, max_new))
        else:  # trainer state, engines at its version, the queue's untrained rows
            base = await restore_async(trainer, pipeline, trainer.resumed)
        trainer.base_eval = base
        gate = StalenessGate(cfg.rollout.prompts_per_step, cfg.rollout.max_staleness, cfg.rollout.forced_lag)
        env_groups = (cfg.agentic.num_env_groups or cfg.rollout.prompts_per_step) - cfg.rollout.prompts_per_step
        ledger = GroupLedger(gate, redundant_groups=cfg.rollout.redundant_groups + env_groups)
        controller = AsyncController(pipeline, ledger, cfg.rollout.prompts_per_step)
        trainer.controller = controller

        async def after_step(version: int, chosen: list[int], metrics: dict[str, float]) -> bool:
            trainer.version = version
            trainer.trained_ids_log.log("trained", step=version, ids=await pipeline.trained_ids())
            if trainer.eval_due(version):
                trainer.log_eval(await pipeline.evaluate(trainer.eval_items, max_new), version)
            keep_going = trainer.after_step(version, step_stats(controller, chosen, version, metrics), metrics)
            if checkpoint_due(trainer, version):
                await save_async_checkpoint(trainer, controller, pipeline, version)
            return keep_going

        await pipeline.trace_events()  # drop the base evaluation: the trace covers the loop only
        if trainer.resumed is not None:  # restart the groups that were generating at the checkpoint
            resume_controller(controller, trainer.resumed)
        cpu, started = CpuMeter(), time.monotonic()  # the /proc scan outside the timed loop
        await controller.run(cfg.run.steps, after_step)
        trainer.loop_seconds = time.monotonic() - started
        trainer.metrics.log("cpu", **cpu.read())  # every process's CPU seconds in the loop, by role
        (t_version, t_sum), (e_version, e_sum) = await pipeline.fingerprints()
        engine = await pipeline.engine_stats()
        trainer.metrics.log(
            "weights",
            trainer_version=t_version,
            trainer_checksum=t_sum,
            engine_version=e_version,
            engine_checksum=e_sum,
            **{f"engine_{k}": engine[k] for k in ENGINE_SYNC_STATS if k in engine},
        )
        trainer.metrics.log("rewards", **{k: v for k, v in engine.items() if k.startswith("reward_")})
        if spec.agentic is not None:  # episode counters: kept, aborted stragglers, env failures
            trainer.metrics.log("episodes", **{k: v for k, v in engine.items() if k.startswith("env_")})
        if cfg.run.trace:
            events = await pipeline.trace_events()
            write_chrome_trace(trainer.run_dir / "trace.json", [events])
            trainer.metrics.log("trace", **trace_numbers(events))
        final = trainer.log_eval(await pipeline.evaluate(trainer.eval_items, max_new))
        trainer.metrics.log("fates", **controller.ledger.counters(), **_staleness(controller.ledger))
        await pipeline.save(str(trainer.final_model_dir))
        return base, final
    finally:
        pipeline.close()


def step_stats(
    controller: AsyncController, chosen: list[int], version: int, metrics: dict[str, float]
) -> dict[str, float]:
    """Rollout statistics of the groups a step trained, from their reports (no sample data).

    ``trained_before_generated`` is 1 when the trainer's first micro-batch of the step started
    before the step's last group finished generating: streaming overlap inside a step.
    """
    reports = [controller.reports[g] for g in chosen]
    last_generated = max((rep.finished_at for rep in reports), default=0.0)
    first_trained = metrics.get("first_microbatch_at", 0.0)
    rewards = [r for rep in reports for r in rep.rewards]
    samples = max(len(rewards), 1)
    mixed = sum(1 for rep in reports if len(set(rep.rewards)) > 1)
    staleness = [version - 1 - rep.version for rep in reports]
    sample_staleness = [version - 1 - v for rep in reports for v in rep.sample_versions]
    return {
        "reward_mean": sum(rewards) / samples,
        "response_len_mean": sum(rep.response_tokens for rep in reports) / samples,
        "groups_with_signal": mixed / max(len(reports), 1),
        "trained_tokens": float(sum(rep.response_tokens for rep in reports)),
        "staleness_max": float(max(staleness, default=0)),
        "staleness_mean": sum(staleness) / max(len(staleness), 1),
        "sample_staleness_mean": sum(sample_staleness) / max(len(sample_staleness), 1),
        "engine_version": float(controller.pipeline.engine_version),
        "trained_before_generated": float(0 < first_trained < last_generated),
        **controller.sync_metrics,
    }


def _staleness(ledger: GroupLedger) -> dict[str, float]:
    """Realised staleness histograms: ``staleness_k`` groups and ``sample_staleness_k`` samples."""
    groups = {f"staleness_{k}": float(v) for k, v in sorted(ledger.staleness.items())}
    samples = {f"sample_staleness_{k}": float(v) for k, v in sorted(ledger.sample_staleness.items())}
    return {**groups, **samples}

"""A whole training run over the pipeline's workers: evaluate, run the controller, collect.

Every mode runs here: ``run.mode: async`` is the controller's streaming schedule under the
staleness bound, ``run.mode: sync`` the same controller and workers with the barrier schedule
(admit a step's groups, wait for all of them, train, sync weights). It places the workers
(``runtime/pipelines.py``, ``runtime/ray_pipeline.py``), runs the base, periodic
(``run.eval_every``) and final evaluations on the rollout engine (none with ``run.eval_every: 0``
or an empty evaluation set), turns group reports into per-step statistics, saves the final
model and writes the timeline (``trace.json``), the sample-fate counters and, every
``tracking.samples_every`` steps, a few of the trained samples (``samples.jsonl``). A stop request
(SIGTERM / SIGINT, ``runtime/preemption.py``) ends the loop after the current step with a
checkpoint. With ``fleet.rebalance`` each step is followed by a rebalancing decision
(``rebalancing.py``). It adds no scheduling logic of its own.
"""

from __future__ import annotations

import logging
import time

from sluice.config import ConfigError, SluiceConfig
from sluice.controller.loop import Admission, Controller, StepCallback
from sluice.controller.multi import MultiRayPipeline, PullAdmission
from sluice.controller.push import PushAdmission
from sluice.controller.rebalancing import RunRebalancer, rebalance_rule, restore_replicas
from sluice.controller.resume import DriverState, restore_checkpoint, save_checkpoint
from sluice.controller.run_state import TrainingRun
from sluice.dag.loader import write_prompt_file
from sluice.data import PromptStream
from sluice.rollout.evaluate import EvalResult
from sluice.runtime.pipelines import LocalPipeline, PipelineSpec
from sluice.runtime.preemption import Preemption, RunPreempted
from sluice.runtime.ray_pipeline import RayPipeline, RayWorkers
from sluice.runtime.supervision import Watchdog, supervised
from sluice.schedule.failures import FailureBudget, RunStopped
from sluice.schedule.ledger import GroupLedger
from sluice.schedule.staleness import StalenessGate
from sluice.telemetry.cpu import CpuMeter
from sluice.telemetry.disk_faults import DiskFault, disk_faults
from sluice.telemetry.trace import trace_numbers, write_chrome_trace

log = logging.getLogger(__name__)

ENGINE_SYNC_STATS = (
    "weight_updates",
    "weight_updates_superseded",
    "weight_drain_s",
    "reprefill_tokens",
    "stale_cache_rows",
    "prefills",
    "prefill_tokens",
    "session_hits",
    "session_hit_tokens",
    "session_kept",
    "session_dropped",
    "steps",
    "generated_tokens",
    "drive_s",
    "holds",
    "hold_s",
    "proxy_routed",
    "proxy_rerouted",
)


def place_pipeline(run: TrainingRun, spec: PipelineSpec) -> tuple[LocalPipeline | RayWorkers, Admission]:
    """The run's workers on ``run.backend`` (one process, ``local``, or an actor each, ``ray``)
    and how its groups are admitted: the driver's waves (``push.py``), or, with
    ``run.controller: multi``, credits the rollout workers pull, each over its shard of the
    prompts, written once to the run's ``prompts.jsonl`` (``multi.py``)."""
    config, prompts = run.config, run.prompts
    gate, barrier = StalenessGate.of(config.rollout), config.run.mode == "sync"
    if config.run.controller == "multi":
        if spec.agentic is not None:
            raise ConfigError("run.controller=multi: single-turn tasks only (this task runs an environment)")
        source = write_prompt_file(prompts.items, run.run_dir / "prompts.jsonl")
        multi = MultiRayPipeline(spec, prompts, source, config.run.ray_address)
        return multi, PullAdmission(multi, gate, barrier=barrier)
    pipeline = place_single(config, spec, prompts)
    per_step = config.rollout.prompts_per_step
    env_groups = (config.agentic.num_env_groups or per_step) - per_step
    ledger = GroupLedger(gate, redundant_groups=config.rollout.redundant_groups + env_groups)
    failures = FailureBudget(config.run.failure_budget, config.run.failure_window)
    return pipeline, PushAdmission(pipeline, ledger, per_step, barrier=barrier, failures=failures)


def place_single(config: SluiceConfig, spec: PipelineSpec, prompts: PromptStream) -> LocalPipeline | RayPipeline:
    """The single controller's workers: one process (``local``) or an actor each (``ray``)."""
    if config.run.backend == "ray":
        return RayPipeline(spec, prompts, config.run.ray_address)
    return LocalPipeline(spec, prompts)


async def run_training(
    run: TrainingRun, spec: PipelineSpec, resumed: DriverState | None, stop: Preemption | None = None
) -> tuple[EvalResult | None, EvalResult | None]:
    """Place the workers, run ``run.config.run.steps`` steps, evaluate before, every
    ``run.eval_every`` steps and after; the evaluations are ``None`` when the run has none.

    ``stop`` requested (SIGTERM / SIGINT): after the current step a checkpoint is written (unless
    that step's was), then ``RunPreempted``; before the first step, ``RunPreempted`` at once."""
    cfg = run.config
    stop = stop or Preemption()
    preempted: list[RunPreempted] = []
    if not cfg.run.eval_every:
        log.info("no evaluation: run.eval_every is 0")
    elif not run.eval_items:
        log.warning("no evaluation: the evaluation set is empty (data.val_files gives one)")
    _stop_if_asked(stop, run)
    pipeline, admission = place_pipeline(run, spec)
    try:
        _stop_if_asked(stop, run)
        # start-up under the workers' heartbeats (its length is not judged): an actor stopped
        # while a resume restores or the base evaluation runs is named like one stopped mid-run
        starting = Watchdog(cfg.run.stall_timeout_s, pipeline.heartbeats(), lambda: None, lambda: stop.at)
        with starting.paused():
            base = await supervised(_start(run, pipeline, resumed), starting)
        run.base_eval = base
        _stop_if_asked(stop, run)
        before = await pipeline.trace_events()  # the base evaluation's span (a resume's restore is dropped)
        controller = Controller(pipeline, admission)
        rebalancer = RunRebalancer(rebalance_rule(cfg), pipeline, run.metrics) if cfg.fleet.rebalance else None
        if rebalancer is not None:
            await rebalancer.start()
        # a silent worker, or a loop that stops moving, ends the run (runtime/supervision.py)
        # ... and so does a stop request the loop has not honoured within the same time
        watchdog = Watchdog(cfg.run.stall_timeout_s, pipeline.heartbeats(), controller.progress, lambda: stop.at)

        async def after_step(version: int, chosen: list[int], metrics: dict[str, float]) -> bool:
            run.trained_ids_log.log("trained", step=version, ids=await pipeline.trained_ids())
            if rebalancer is not None:  # add or remove a rollout replica (fleet.rebalance)
                await rebalancer.after_step(version, metrics)
                run.rollout_replicas = rebalancer.replicas  # checkpointed: a resume starts with them
            if run.eval_due(version) and not stop.requested:
                with watchdog.paused():
                    await _evaluate(run, pipeline, version)
                if rebalancer is not None:  # evaluation is not the step's generation
                    await rebalancer.start()
            keep_going = run.log_step(version, step_stats(controller, chosen, version, metrics), metrics)
            if run.samples_due(version):  # a few of the step's samples, as token ids, decoded here
                run.log_samples(version, await pipeline.trained_samples(cfg.tracking.samples_per_step))
            checkpoint = None
            if run.checkpoint_due(version):
                with watchdog.paused():
                    checkpoint = await save_checkpoint(run, await admission.cut(), pipeline, version)
            if stop.signal is not None:  # preemption: a checkpoint whatever the period, then stop
                with watchdog.paused():
                    checkpoint = checkpoint or await save_checkpoint(run, await admission.cut(), pipeline, version)
                preempted.append(RunPreempted(stop.signal, version, checkpoint))
                return False
            return keep_going

        if resumed is not None:  # restart the groups that were generating at the checkpoint
            await admission.resume(resumed.cut, resumed.version)
        cpu, started = CpuMeter(), time.monotonic()  # the /proc scan outside the timed loop
        await _supervised_loop(run, controller, pipeline, watchdog, after_step)
        run.loop_seconds = time.monotonic() - started
        if preempted:  # a signal after the last step's callback finishes the run instead
            raise preempted[0]
        run.metrics.log("cpu", **cpu.read())  # every process's CPU seconds in the loop, by role
        await _log_run_end(run, controller, pipeline, spec)
        loop = await pipeline.trace_events()
        final = await _evaluate(run, pipeline)
        if cfg.run.trace:  # the timeline shows the evaluations; its numbers cover the loop alone
            after = await pipeline.trace_events()
            write_chrome_trace(run.run_dir / "trace.json", [before if resumed is None else [], loop, after])
            run.metrics.log("trace", **trace_numbers(loop))
        run.metrics.log("fates", **controller.ledger.counters(), **_staleness(controller.ledger))
        for kind, record in pipeline.end_records().items():  # sample bytes through the driver, shards
            run.metrics.log(kind, **record)
        with disk_faults(run.final_model_dir, any_error=True):  # torch / safetensors raise no OSError
            await pipeline.save(str(run.final_model_dir))
        return base, final
    except Exception as err:  # a worker's death outside the loop (restore, final evaluation): its one line
        stopped = None if isinstance(err, RunStopped | RunPreempted) else pipeline.explain(err)
        if stopped is None:
            raise
        raise stopped from err
    finally:
        pipeline.close()


async def _start(
    run: TrainingRun, pipeline: LocalPipeline | RayWorkers, resumed: DriverState | None
) -> EvalResult | None:
    """A fresh run's base evaluation, or a resume's restore (trainer state, engines at its
    version, the queue's untrained rows) and the base evaluation it recorded."""
    if resumed is None:
        return await _evaluate(run, pipeline)
    base = await restore_checkpoint(run, pipeline, resumed)
    if run.config.fleet.rebalance and resumed.rollout_replicas is not None:  # the count rebalancing left
        run.rollout_replicas = await restore_replicas(rebalance_rule(run.config), pipeline, resumed.rollout_replicas)
    return base


def _stop_if_asked(stop: Preemption, run: TrainingRun) -> None:
    """Before the first step: a stop request ends the run now (nothing trained since the
    checkpoint it resumed from, if any)."""
    if stop.signal is not None:
        raise RunPreempted(stop.signal, run.version, None)


async def _supervised_loop(
    run: TrainingRun,
    controller: Controller,
    pipeline: LocalPipeline | RayWorkers,
    watchdog: Watchdog,
    after_step: StepCallback,
) -> None:
    """The controller's steps under the watchdog. A stop (``RunStopped``, or a worker's death
    the pipeline explains) logs the books so far (not to a disk that refused a write), then
    propagates as its one line."""
    try:
        await supervised(controller.run(run.config.run.steps, after_step), watchdog)
    except Exception as err:
        stopped = err if isinstance(err, RunStopped) else pipeline.explain(err)
        if stopped is None:
            raise
        if not isinstance(stopped, DiskFault):  # a disk that refuses writes gets no more of them
            run.metrics.log("fates", **controller.ledger.counters(), stopped=str(stopped))
        if stopped is err:
            raise
        raise stopped from err


async def _evaluate(
    run: TrainingRun, pipeline: LocalPipeline | RayWorkers, step: int | None = None
) -> EvalResult | None:
    """One evaluation on the rollout engines (logged), or ``None`` when the run has none."""
    if not run.evaluates:
        return None
    result = await pipeline.evaluate(run.eval_items, run.max_new_tokens, run.config.eval)
    return run.log_eval(result, step)


async def _log_run_end(
    run: TrainingRun,
    controller: Controller,
    pipeline: LocalPipeline | RayWorkers,
    spec: PipelineSpec,
) -> None:
    """The workers' end-of-run numbers: weight fingerprints, engine and reward counters."""
    (t_version, t_sum), (e_version, e_sum) = await pipeline.fingerprints()
    engine = await pipeline.engine_stats()
    run.metrics.log(
        "weights",
        trainer_version=t_version,
        trainer_checksum=t_sum,
        engine_version=e_version,
        engine_checksum=e_sum,
        **{f"engine_{k}": engine[k] for k in ENGINE_SYNC_STATS if k in engine},
    )
    run.metrics.log("rewards", **{k: v for k, v in engine.items() if k.startswith(("reward_", "rm_", "judge_"))})
    run.metrics.log("proxy", **{k.removeprefix("proxy_"): v for k, v in engine.items() if k.startswith("proxy_")})
    if spec.agentic is not None:  # episode counters: kept, aborted stragglers, env failures
        run.metrics.log("episodes", **{k: v for k, v in engine.items() if k.startswith("env_")})


def step_stats(controller: Controller, chosen: list[int], version: int, metrics: dict[str, float]) -> dict[str, float]:
    """Rollout statistics of the groups a step trained, from their reports (no sample data):
    the reward's mean / std / min / max (and its mean per ``data_source``, ``reward_mean/SOURCE``,
    when the rows name more than one), response lengths (mean, max) and the share of responses
    cut at the length cap (``response_clip_ratio``); ``docs/tracking.md`` maps them to verl's names.

    ``trained_before_generated`` is 1 when the trainer's first micro-batch of the step started
    before the step's last group finished generating: streaming overlap inside a step.
    """
    reports = [controller.reports[g] for g in chosen]
    last_generated = max((rep.finished_at for rep in reports), default=0.0)
    first_trained = metrics.get("first_microbatch_at", 0.0)
    rewards = [r for rep in reports for r in rep.rewards]
    samples = max(len(rewards), 1)
    mean = sum(rewards) / samples
    lengths = [n for rep in reports for n in rep.response_lengths]
    by_source: dict[str, list[float]] = {}
    for rep in reports:
        by_source.setdefault(rep.data_source, []).extend(rep.rewards)
    mixed = sum(1 for rep in reports if len(set(rep.rewards)) > 1)
    staleness = [version - 1 - rep.version for rep in reports]
    sample_staleness = [version - 1 - v for rep in reports for v in rep.sample_versions]
    per_source = (
        {f"reward_mean/{s}": sum(v) / len(v) for s, v in by_source.items() if s and v} if len(by_source) > 1 else {}
    )
    rm = [x for rep in reports for x in rep.rm_scores]
    return {
        **({"rm_score_mean": sum(rm) / len(rm)} if rm else {}),
        "reward_mean": mean,
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / samples) ** 0.5,
        "reward_min": min(rewards, default=0.0),
        "reward_max": max(rewards, default=0.0),
        **per_source,
        "response_len_mean": sum(rep.response_tokens for rep in reports) / samples,
        "response_len_max": float(max(lengths, default=0)),
        "response_clip_ratio": sum(rep.truncated for rep in reports) / samples,
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

"""Placement of the asynchronous pipeline's workers: in one process (``local``) or as Ray actors.

Both build the same three parts — a TransferQueue, one ``RolloutWorker``, one ``TrainerWorker`` —
plus a weight sync, and expose them through the ``AsyncPipeline`` verbs the controller drives.
Queue tasks after generation get a worker of their own: the reference log-probs (KL term) and,
for PPO, the critic's values (with a second weight sync carrying the critic the trainer updates).
``local`` runs the rollout worker on the event loop and the trainer in a worker thread (torch
releases the GIL in its kernels, so they overlap); ``ray`` gives each role its own actor and
process. Nothing here decides what to run when.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.api import Algorithm, GroupReport, PromptItem, RewardFn, SamplingParams, WeightSync
from sluice.config.fleet import FleetConfig
from sluice.config.models import RewardConfig
from sluice.queue import AsyncLocalQueue, LocalQueue
from sluice.queue.samples import train_columns
from sluice.rollout.agentic import EnvRolloutSpec
from sluice.rollout.evaluate import EvalResult
from sluice.rollout.filters import GroupFilter
from sluice.rollout.worker import RolloutWorker
from sluice.tasks.dataset import PromptStream
from sluice.trainer.column_task import ColumnTaskWorker
from sluice.trainer.critic_task import CRITIC_TASK, CriticValuesWorker
from sluice.trainer.ppo import VALUES_COLUMN, CriticSpec
from sluice.trainer.reference import REF_INPUT_COLUMNS, REF_TASK, ReferenceWorker
from sluice.trainer.updates import ONE_UPDATE, UpdateSchedule
from sluice.trainer.worker import TRAIN_TASK, TrainerWorker
from sluice.weights import InProcessWeightSync

WEIGHT_POLL_S = 0.005


@dataclass
class PipelineSpec:
    """Everything the workers are built from (picklable, so Ray actors can receive it)."""

    model_dir: Path
    reward: RewardFn
    params: SamplingParams
    group_size: int
    run_seed: int
    max_batch: int
    algorithm: Algorithm
    engine_kwargs: dict[str, Any]
    micro_batch_tokens: int
    weight_update: str
    group_filter: GroupFilter | None = None
    reward_config: RewardConfig | None = None
    rollout_threads: int = 1
    trainer_threads: int = 1
    trace: bool = True
    replicas: int = 1
    prompt_replication: bool = True
    stagger: int = 1
    scheduling: str = "queue"
    update_schedule: UpdateSchedule = ONE_UPDATE
    data_parallel: int = 1
    engine: str = "hf"
    engine_options: dict[str, Any] = field(default_factory=dict)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    tasks: dict[str, tuple[str, ...]] | None = None
    """The queue's tasks and their input columns, compiled from the run's DAG (``None``: from the algorithm)."""
    agentic: EnvRolloutSpec | None = None
    """Multi-turn episodes of an environment instead of single-turn groups (``rollout/agentic.py``)."""
    critic: CriticSpec | None = None
    """PPO's critic: a critic-values worker serves the ``critic`` task, the trainer updates it."""


class _Pipeline:
    """The verbs shared by both placements; subclasses say how to call the workers."""

    queue: Any

    def __init__(self, spec: PipelineSpec, prompts: PromptStream) -> None:
        self.spec = spec
        self.prompts = prompts
        self.engine_version = 0

    def next_prompt(self) -> PromptItem:
        return self.prompts.take(1)[0]

    async def queue_snapshot(self) -> dict[str, Any]:
        """The queue's plain-data state (for a checkpoint; ``controller/resume.py`` filters it)."""
        return await asyncio.to_thread(self.queue.snapshot)

    async def queue_restore(self, state: dict[str, Any]) -> None:
        await asyncio.to_thread(self.queue.restore, state)


class LocalPipeline(_Pipeline):
    """All workers in this process: rollout on the event loop, trainer in one worker thread."""

    def __init__(self, spec: PipelineSpec, prompts: PromptStream) -> None:
        if spec.data_parallel > 1:
            raise ValueError("trainer.data_parallel > 1 needs run.backend: ray (one process per rank)")
        super().__init__(spec, prompts)
        self.queue = LocalQueue()
        for task, columns in queue_tasks(spec).items():
            self.queue.register_task(task, columns)
        self.weight_sync = InProcessWeightSync()
        critic_sync = InProcessWeightSync() if spec.critic is not None else None
        self.rollout_worker = RolloutWorker(**_rollout_kwargs(spec, AsyncLocalQueue(self.queue)))
        self.trainer = TrainerWorker(**_trainer_kwargs(spec, self.queue, self.weight_sync, critic_sync))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-trainer")
        self._column_tasks = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sluice-column-task")
        self._served: list[Future[int]] = []
        """Each serves its queue task until the queue closes (``close`` raises what one raised)."""
        if spec.algorithm.uses_reference:
            self._serve(ReferenceWorker(spec.model_dir, self.queue, spec.engine_kwargs))
        if spec.critic is not None and critic_sync is not None:
            self._serve(CriticValuesWorker(spec.model_dir, self.queue, spec.critic, critic_sync))

    def _serve(self, worker: ColumnTaskWorker) -> None:
        served = self._column_tasks.submit(worker.serve)
        # a failed task would leave the trainer waiting for its column: close the queue instead
        served.add_done_callback(lambda done: done.exception() is not None and self.queue.close())
        self._served.append(served)

    async def rollout_wave(self, groups: Sequence[tuple[PromptItem, int]]) -> AsyncIterator[GroupReport]:
        async for report in self.rollout_worker.run_groups(groups):
            yield report

    async def abort_groups(self, group_ids: list[int], reason: str) -> None:
        self.rollout_worker.abort_groups(group_ids, reason)

    async def begin_step(self) -> None:
        await self._in_trainer(self.trainer.begin_step)

    async def train_groups(self, group_ids: list[int]) -> None:
        await self._in_trainer(self.trainer.add_groups, group_ids)

    async def finish_step(self) -> dict[str, float]:
        return await self._in_trainer(self.trainer.finish_step)

    async def sync_weights(self, version: int) -> dict[str, float]:
        metrics = await self.rollout_worker.load_version(self.weight_sync, version, self.spec.weight_update)
        await wait_engine_version(self.engine_stats, version)
        self.engine_version = version
        return metrics

    async def evaluate(self, items: Sequence[PromptItem], max_new_tokens: int) -> EvalResult:
        return await self.rollout_worker.evaluate(items, max_new_tokens)

    async def engine_stats(self) -> dict[str, float]:
        return await self.rollout_worker.engine_stats()

    async def trace_events(self) -> list[dict[str, Any]]:
        return self.rollout_worker.drain_trace() + self.trainer.drain_trace()

    async def save(self, path: str) -> None:
        await self._in_trainer(self.trainer.save, path)

    async def trained_ids(self) -> list[str]:
        return self.trainer.trained_ids()

    async def save_state(self, path: str) -> None:
        await self._in_trainer(self.trainer.save_state, path)

    async def load_state(self, path: str) -> int:
        return await self._in_trainer(self.trainer.load_state, path)

    async def fingerprints(self) -> tuple[tuple[int, float], tuple[int, float]]:
        """((trainer version, checksum), (engine version, checksum))."""
        return self.trainer.weights_fingerprint(), await self.rollout_worker.weights_fingerprint()

    def close(self) -> None:
        self.queue.close()
        self.rollout_worker.close()
        self._thread.shutdown(wait=True)
        self._column_tasks.shutdown(wait=True)
        for served in self._served:
            served.result()  # re-raises a column task's failure

    async def _in_trainer(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)


class RayPipeline(_Pipeline):
    """One Ray actor per role (rollout, trainer) plus the queue's storage and controller actors;
    with ``data_parallel`` > 1, that many trainer actors form one process group, and each step's
    groups are dealt to them by tokens (each to the rank with the fewest so far)."""

    def __init__(self, spec: PipelineSpec, prompts: PromptStream, address: str | None = None) -> None:
        import ray

        from sluice.queue import RayQueue

        super().__init__(spec, prompts)
        ensure_ray(address)
        self.queue = RayQueue.create(num_storage_units=1, tasks=queue_tasks(spec))
        self.weight_sync, self.engine_weight_sync = weight_syncs(spec.fleet, f"sluice-weights-{os.getpid()}-{id(self)}")
        over = spec.rollout_threads + spec.trainer_threads * spec.data_parallel > (os.cpu_count() or 1)
        # Every actor must be placed at once (the trainer ranks meet in a rendezvous, the trainer
        # waits on the reference worker), so they share the cluster's CPUs rather than queue for them.
        share = actor_cpu_share(ray.cluster_resources().get("CPU", 1.0), spec)
        rollout_cls: Any = ray.remote(RolloutWorker).options(**_actor_options(spec.rollout_threads, over, share))
        self.rollout_actor = rollout_cls.remote(**_rollout_kwargs(spec, self.queue.as_async()))
        trainer_cls: Any = ray.remote(TrainerWorker).options(**_actor_options(spec.trainer_threads, over, share))
        self.critic_sync = None  # held here: the registry actor lives as long as this handle
        if spec.critic is not None:
            from sluice.weights import ObjectStoreWeightSync

            self.critic_sync = ObjectStoreWeightSync(name=f"sluice-critic-{os.getpid()}-{id(self)}")
        kwargs = _trainer_kwargs(spec, self.queue, self.weight_sync, self.critic_sync)
        self.trainer_actors = [trainer_cls.remote(**kwargs) for _ in range(spec.data_parallel)]
        self.trainer_actor = self.trainer_actors[0]  # rank 0: publishes weights, saves
        if spec.data_parallel > 1:
            meet = ray.get(self.trainer_actor.rendezvous_address.remote())
            ray.get(
                [a.join_data_parallel.remote(meet, r, spec.data_parallel) for r, a in enumerate(self.trainer_actors)]
            )
        self._group_tokens: dict[int, int] = {}
        self._rank_tokens: list[int] = []
        self._step_groups = 0
        """Groups handed to the ranks this step: the next group's position in the step."""
        self.reference_actor = None
        self._served: list[Any] = []
        """``serve`` calls of the column-task actors: they return only when the queue shuts down."""
        if spec.algorithm.uses_reference:
            reference_cls: Any = ray.remote(ReferenceWorker).options(**_actor_options(1, True, share))
            self.reference_actor = reference_cls.remote(spec.model_dir, self.queue, spec.engine_kwargs)
            self._served.append(self.reference_actor.serve.remote())
        self.critic_actor = None
        if spec.critic is not None:
            critic_cls: Any = ray.remote(CriticValuesWorker).options(**_actor_options(1, True, share))
            self.critic_actor = critic_cls.remote(spec.model_dir, self.queue, spec.critic, self.critic_sync)
            self._served.append(self.critic_actor.serve.remote())

    async def rollout_wave(self, groups: Sequence[tuple[PromptItem, int]]) -> AsyncIterator[GroupReport]:
        stream = self.rollout_actor.run_groups.options(num_returns="streaming").remote(list(groups))
        prompt_tokens = {gid: len(item.prompt_ids) for item, gid in groups}
        async for ref in stream:
            report: GroupReport = await ref
            # a group's training cost in the packed layout: its prompt once, then every response
            self._group_tokens[report.group_id] = prompt_tokens[report.group_id] + report.response_tokens
            yield report

    async def abort_groups(self, group_ids: list[int], reason: str) -> None:
        await self.rollout_actor.abort_groups.remote(group_ids, reason)

    async def begin_step(self) -> None:
        self._rank_tokens = [0 for _ in self.trainer_actors]
        self._step_groups = 0
        await asyncio.gather(*(a.begin_step.remote() for a in self.trainer_actors))

    async def train_groups(self, group_ids: list[int]) -> None:
        """Deal the groups to ranks, each to the one with the fewest tokens this step so far, with
        its position in the step (the ranks cut PPO mini-batches over the step's order)."""
        dealt: list[list[int]] = [[] for _ in self.trainer_actors]
        positions: list[list[int]] = [[] for _ in self.trainer_actors]
        for gid in group_ids:
            rank = min(range(len(dealt)), key=lambda r: (self._rank_tokens[r], r))
            dealt[rank].append(gid)
            positions[rank].append(self._step_groups)
            self._step_groups += 1
            self._rank_tokens[rank] += self._group_tokens.pop(gid, 0)
        calls = [
            a.add_groups.remote(gids, where)
            for a, gids, where in zip(self.trainer_actors, dealt, positions, strict=True)
            if gids
        ]
        await self._unless_a_task_stopped(asyncio.gather(*calls))

    async def _unless_a_task_stopped(self, work: Awaitable[Any]) -> None:
        """Await ``work``, but raise if a column task stops first: the trainer would wait for its
        column forever."""
        running = asyncio.ensure_future(work)
        served = [asyncio.ensure_future(_awaited(ref)) for ref in self._served]
        try:
            await asyncio.wait([running, *served], return_when=asyncio.FIRST_COMPLETED)
            stopped = next((task for task in served if task.done()), None)
            if stopped is not None and not running.done():
                stopped.result()  # its error, if it failed
                raise RuntimeError("a queue task's worker stopped while the trainer waited for its column")
            await running
        finally:
            for task in served:
                task.cancel()

    async def finish_step(self) -> dict[str, float]:
        """Every rank's optimizer step (they meet in the gradient all-reduce); rank 0 reports."""
        results = await asyncio.gather(*(a.finish_step.remote() for a in self.trainer_actors))
        return results[0]

    async def sync_weights(self, version: int) -> dict[str, float]:
        sync, mode = self.engine_weight_sync, self.spec.weight_update
        metrics = await self.rollout_actor.load_version.remote(sync, version, mode)
        await wait_engine_version(self.engine_stats, version)
        self.engine_version = version
        return metrics

    async def evaluate(self, items: Sequence[PromptItem], max_new_tokens: int) -> EvalResult:
        return await self.rollout_actor.evaluate.remote(list(items), max_new_tokens)

    async def engine_stats(self) -> dict[str, float]:
        return await self.rollout_actor.engine_stats.remote()

    async def trace_events(self) -> list[dict[str, Any]]:
        actors = [self.rollout_actor, *self.trainer_actors]
        parts = await asyncio.gather(*(a.drain_trace.remote() for a in actors))
        return [e for part in parts for e in part]

    async def save(self, path: str) -> None:
        await self.trainer_actor.save.remote(path)

    async def trained_ids(self) -> list[str]:
        return await self.trainer_actor.trained_ids.remote()  # rank 0 holds every rank's

    async def save_state(self, path: str) -> None:
        await self.trainer_actor.save_state.remote(path)  # the ranks are replicas

    async def load_state(self, path: str) -> int:
        versions = await asyncio.gather(*(a.load_state.remote(path) for a in self.trainer_actors))
        return versions[0]

    async def fingerprints(self) -> tuple[tuple[int, float], tuple[int, float]]:
        """((trainer version, checksum), (engine version, checksum)), each from its own actor; every
        data-parallel rank must hold rank 0's weights."""
        engine, *ranks = await asyncio.gather(
            self.rollout_actor.weights_fingerprint.remote(),
            *(a.weights_fingerprint.remote() for a in self.trainer_actors),
        )
        if any(r != ranks[0] for r in ranks):
            raise RuntimeError(f"data-parallel trainer ranks diverged: (version, checksum) per rank {ranks}")
        return ranks[0], engine

    def close(self) -> None:
        import ray

        for handle in (self.rollout_actor, *self.trainer_actors, self.reference_actor, self.critic_actor):
            if handle is not None:
                ray.kill(handle)
        self.queue.shutdown()


async def _awaited(ref: Any) -> Any:
    return await ref


async def wait_engine_version(engine_stats: Callable[[], Awaitable[dict[str, float]]], version: int) -> None:
    """``defer`` swaps only after the running sequences drain: wait until the engine holds ``version``."""
    while (await engine_stats())["version"] < version:
        await asyncio.sleep(WEIGHT_POLL_S)


def weight_syncs(fleet: FleetConfig, name: str) -> tuple[WeightSync, WeightSync]:
    """(the trainer's, the rollout worker's) views of the run's weight transfer (``fleet.*``)."""
    from sluice.weights import BroadcastWeightSync, ObjectStoreWeightSync

    if fleet.weight_transfer == "broadcast":
        from sluice.trainer.data_parallel import free_tcp_address

        group = BroadcastWeightSync(
            free_tcp_address(), receivers=1, backend=fleet.broadcast_backend, timeout_s=fleet.broadcast_timeout_s
        )
        return group.publisher(), group.receiver(1)
    sync = ObjectStoreWeightSync(name=name)
    return sync, sync


def queue_tasks(spec: PipelineSpec) -> dict[str, tuple[str, ...]]:
    """The queue's tasks and their input columns: the DAG's, else ``train`` plus ``reference`` for a
    KL term and ``critic`` for PPO's values (which ``train`` then reads)."""
    if spec.tasks is not None:
        return dict(spec.tasks)
    values = (VALUES_COLUMN,) if spec.critic is not None else ()
    tasks = {TRAIN_TASK: train_columns(spec.algorithm.uses_reference) + values}
    if spec.algorithm.uses_reference:
        tasks[REF_TASK] = REF_INPUT_COLUMNS
    if spec.critic is not None:
        tasks[CRITIC_TASK] = CriticValuesWorker.inputs
    return tasks


def _rollout_kwargs(spec: PipelineSpec, queue: Any) -> dict[str, Any]:
    return {
        "model_dir": spec.model_dir,
        "queue": queue,
        "reward": spec.reward,
        "params": spec.params,
        "group_size": spec.group_size,
        "run_seed": spec.run_seed,
        "max_batch": spec.max_batch,
        "group_filter": spec.group_filter,
        "reward_config": spec.reward_config,
        "threads": spec.rollout_threads,
        "trace": spec.trace,
        "replicas": spec.replicas,
        "prompt_replication": spec.prompt_replication,
        "stagger": spec.stagger,
        "scheduling": spec.scheduling,
        "engine": spec.engine,
        "engine_options": spec.engine_options,
        "fleet": spec.fleet,
        "agentic": spec.agentic,
    }


def _trainer_kwargs(spec: PipelineSpec, queue: Any, weight_sync: Any, critic_sync: Any = None) -> dict[str, Any]:
    return {
        "model_dir": spec.model_dir,
        "queue": queue,
        "algorithm": spec.algorithm,
        "weight_sync": weight_sync,
        "group_size": spec.group_size,
        "micro_batch_tokens": spec.micro_batch_tokens,
        "schedule": spec.update_schedule,
        "engine_kwargs": spec.engine_kwargs,
        "threads": spec.trainer_threads,
        "trace": spec.trace,
        "critic": spec.critic,
        "critic_sync": critic_sync,
    }


def actor_cpu_share(cluster_cpus: float, spec: PipelineSpec) -> float:
    """Ray CPUs per actor so that rollout, every trainer rank, the reference and the critic's
    values worker fit together."""
    actors = 1 + spec.data_parallel + int(spec.algorithm.uses_reference) + int(spec.critic is not None)
    return min(1.0, cluster_cpus / actors)


def _actor_options(threads: int, oversubscribed: bool, cpus: float = 1.0) -> dict[str, Any]:
    """``cpus`` (at most one) for Ray's placement bookkeeping; the real thread count goes to OpenMP."""
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if oversubscribed:  # spinning OpenMP workers would steal cores from the other actor
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return {"num_cpus": cpus, "runtime_env": {"env_vars": env}}


def ensure_ray(address: str | None) -> None:
    """Join ``address``, or start one local Ray instance sized for this machine (once per process)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    ray.init(
        address="local",
        num_cpus=max(2, os.cpu_count() or 2),
        include_dashboard=False,
        object_store_memory=512 * 1024**2,
        log_to_driver=False,
    )

"""The ``ray`` placement of the asynchronous pipeline: one Ray actor per role (rollout, each trainer
rank, the reference and critic-values workers) plus the queue's storage and controller actors,
the rollout and trainer actors in the placement groups ``resources`` asks for
(``runtime/placement.py``), with each actor's thread settings. It builds the same parts as ``LocalPipeline``
(``runtime/pipelines.py``) from the same ``PipelineSpec``; it decides nothing about what runs
when.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from sluice.api import GroupReport, PromptItem
from sluice.config.data import EvalConfig
from sluice.dag.node_worker import NodeTaskWorker
from sluice.dag.spec import DagNode
from sluice.data import PromptStream
from sluice.rollout.evaluate import EvalResult
from sluice.rollout.worker import RolloutWorker
from sluice.runtime.pipelines import (
    PipelineSpec,
    _Pipeline,
    engine_receivers,
    node_worker_kwargs,
    placement,
    queue_tasks,
    rollout_kwargs,
    trainer_kwargs,
    wait_engine_version,
    weight_syncs,
)
from sluice.runtime.placement import RayPlacement, actor_cpu_share, plan_placement
from sluice.runtime.processes import DRIVER_VAR, TAG_VAR
from sluice.runtime.ray_supervision import (
    HEALTH,
    RESTART_TIMEOUT_S,
    ROLLOUT_RESTARTS,
    death_detail,
    explain_death,
    supervised,
    when_alive,
)
from sluice.runtime.supervision import Answers, Heartbeat, WorkerDied, WorkerLost, abandon
from sluice.schedule.failures import RunStopped
from sluice.telemetry.samples import SampleSummary
from sluice.trainer.worker import TrainerWorker
from sluice.weights import ObjectStoreWeightSync
from sluice.weights.broadcast import EngineWorkersFeed

T = TypeVar("T")


class RayWorkers(_Pipeline):
    """One Ray actor per role (rollout, trainer) plus the queue's storage and controller actors;
    with ``resources.trainer.ranks`` > 1, that many trainer actors form one process group. What
    every Ray run asks of its workers (weights, evaluation, checkpoints, health); how a step's
    groups reach them is the driver's admission: pushed (``RayPipeline``) or pulled by the rollout
    workers (``controller/multi.py: MultiRayPipeline``), each a subclass with its own verbs."""

    rollout_class: type[RolloutWorker] = RolloutWorker
    rollout_restarts_allowed = ROLLOUT_RESTARTS
    """How often Ray restarts a dead rollout worker (this pipeline re-syncs the replacement)."""

    def __init__(self, spec: PipelineSpec, prompts: PromptStream, address: str | None = None) -> None:
        import ray

        from sluice.queue import AsyncRayQueue, RayQueue

        super().__init__(spec, prompts)
        self.key = secrets.token_hex(4)
        """This pipeline's part of its named actors' names (a restarted run's next pipeline may
        reuse the first's ``id``)."""
        ensure_ray(address)
        cluster, nodes = ray.cluster_resources(), placement(spec).node_workers
        self.extra_rollouts = spec.config.resources.rollout.workers - 1
        """Rollout workers beside the first (``resources.rollout.workers``: multi-controller runs)."""
        others = self.node_actor_count(nodes) + self.extra_rollouts
        plan = plan_placement(spec.config.resources, cluster, others)
        self.placement = RayPlacement(plan)
        # a row is freed once every task read it: a long run's queue holds the rows in flight only
        units = spec.config.queue.storage_units
        self.queue = RayQueue.create(num_storage_units=units, tasks=queue_tasks(spec), free_consumed=True)
        self.queue_controllers = self.queue.controllers()
        """Each queue task's controller actor (watched like the workers)."""
        fleet = spec.config.fleet  # a broadcast group meets on trainer rank 0's node, not the driver's
        meet = self.placement.free_address_on(plan.trainers[0]) if fleet.weight_transfer == "broadcast" else None
        self.weight_sync, self.engine_weight_sync = weight_syncs(
            fleet,
            f"sluice-weights-{os.getpid()}-{self.key}",
            meet,
            engine_ranks=engine_receivers(spec),
            bucket_mb=spec.config.trainer.weight_bucket_mb,
        )
        rollout_threads = spec.rollout_threads * (1 + self.extra_rollouts)
        over = rollout_threads + spec.trainer_threads * spec.ranks > (os.cpu_count() or 1)
        rollout_options = self.placement.options(plan.rollout) | _runtime(spec.rollout_threads, over)
        # replaceable: Ray restarts it (a fresh worker at version 0), the pipeline re-syncs it
        rollout_options.update(max_restarts=self.rollout_restarts_allowed, max_task_retries=0)
        rollout_cls: Any = supervised(self.rollout_class).options(**rollout_options)
        replicas = self.placement.replica_options()
        feed = self.engine_weight_sync if isinstance(self.engine_weight_sync, EngineWorkersFeed) else None
        self.rollout_actor = rollout_cls.remote(**rollout_kwargs(spec, AsyncRayQueue(self.queue), replicas, feed))
        self._recovering = asyncio.Lock()
        self._syncing: int | None = None
        """The version a weight sync is bringing the rollout worker to (``None``: none in flight)."""
        self.critic_sync = None  # held here: the registry actor lives as long as this handle
        if spec.critic is not None:
            from sluice.weights import ObjectStoreWeightSync

            self.critic_sync = ObjectStoreWeightSync(name=f"sluice-critic-{os.getpid()}-{self.key}")
        kwargs = trainer_kwargs(spec, self.queue, self.weight_sync, self.critic_sync)
        runtime, trainer_cls = _runtime(spec.trainer_threads, over), supervised(TrainerWorker)
        self.trainer_actors = [
            trainer_cls.options(**self.placement.options(slot), **runtime).remote(**kwargs) for slot in plan.trainers
        ]
        self.trainer_actor = self.trainer_actors[0]  # rank 0: publishes weights, saves
        if spec.ranks > 1:
            node_ip = ray.get(self.trainer_actor.node_ip.remote())  # Ray's address of rank 0's node
            meet = ray.get(self.trainer_actor.rendezvous_address.remote(node_ip))
            ray.get([a.join_data_parallel.remote(meet, r, spec.ranks) for r, a in enumerate(self.trainer_actors)])
        self.driver_sample_bytes = 0
        """Bytes of sample data (prompts, generations) the driver sent or received while training,
        as Ray pickles them (evaluation apart): the single controller sends every prompt."""
        share = actor_cpu_share(cluster.get("CPU", 1.0), 1 + spec.ranks + others)
        self.actor_share, self.oversubscribed = share, over
        node_cls: Any = supervised(NodeTaskWorker).options(num_cpus=share, **_runtime(1, True))
        node_kwargs = node_worker_kwargs(spec, self.critic_sync)
        self.node_actors, self._served = self._start_node_workers(nodes, node_cls, node_kwargs)
        self._actor_names = {beat_actor._actor_id.hex(): name for name, beat_actor in self._named_actors()}
        """Ray actor id → the worker's name in a one-line death."""
        self.answers = Answers()
        """When each actor last answered its heartbeat: ``close`` waits for none found silent."""

    @staticmethod
    def node_actor_count(nodes: Sequence[DagNode]) -> int:
        """Actors the node workers take: one per node."""
        return len(nodes)

    def _start_node_workers(
        self, nodes: Sequence[DagNode], node_cls: Any, kwargs: dict[str, Any]
    ) -> tuple[list[Any], list[Any]]:
        """One actor per node after rollout, serving its queue task from now on, and the ``serve``
        calls (they return only when the queue shuts down)."""
        actors = [node_cls.remote(node, self.queue, **kwargs) for node in nodes]
        return actors, [actor.serve.remote() for actor in actors]

    async def recover_rollout(self) -> None:
        """Once Ray has restarted the rollout worker, bring it to the engines' version (the one
        being synced, if a sync is in flight), or to the newest the registry holds if that is
        newer (it keeps only the latest few: a stopped worker may be replaced after the trainer
        moved on). Every wave and call that saw the death awaits the same recovery."""
        async with self._recovering:
            actor = self.rollout_actor
            target = self._syncing if self._syncing is not None else self.engine_version
            target = max(target, await asyncio.to_thread(self.engine_weight_sync.latest_version))
            startup = max(self.spec.config.run.stall_timeout_s, RESTART_TIMEOUT_S)
            stats = await when_alive(actor.engine_stats.remote, startup)
            if int(stats["version"]) >= target:
                return  # recovered already
            if self.spec.config.fleet.weight_transfer == "broadcast":  # its process group died with it
                raise WorkerDied("rollout worker", "fleet.weight_transfer=broadcast cannot re-sync a replacement")
            mode = self.spec.config.rollout.weight_update
            await actor.load_version.remote(self.engine_weight_sync, target, mode)
            await wait_engine_version(actor.engine_stats.remote, target)
            self.engine_version = max(self.engine_version, target)

    async def _on_rollout(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` on the rollout worker; if it died meanwhile, once more on its replacement."""
        from ray.exceptions import RayActorError

        try:
            return await call()
        except RayActorError:
            await self.recover_rollout()
            return await call()

    async def sync_weights(self, version: int) -> dict[str, float]:
        from ray.exceptions import RayActorError

        sync, mode = self.engine_weight_sync, self.spec.config.rollout.weight_update
        self._syncing = version
        try:
            metrics = await self.rollout_actor.load_version.remote(sync, version, mode)
        except RayActorError:  # its replacement is brought to `version` by the recovery
            await self.recover_rollout()
            metrics = {}
        finally:
            self._syncing = None
        if metrics.pop("engine_version", -1.0) < version:  # a recovery, or an older worker's answer
            await wait_engine_version(self.engine_stats, version)
        self.engine_version = max(self.engine_version, version)  # a recovery may have gone further
        return metrics

    async def evaluate(self, items: Sequence[PromptItem], max_new_tokens: int, config: EvalConfig) -> EvalResult:
        return await self._on_rollout(lambda: self.rollout_actor.evaluate.remote(list(items), max_new_tokens, config))

    async def engine_stats(self) -> dict[str, float]:
        return await self._on_rollout(self.rollout_actor.engine_stats.remote)

    async def resize_rollout(self, change: int) -> int:
        """Add or remove replicas behind the rollout worker's proxy (``fleet.rebalance``)."""
        replicas: int = await self._on_rollout(lambda: self.rollout_actor.resize.remote(change))
        return replicas

    async def trace_events(self) -> list[dict[str, Any]]:
        rollout = self._on_rollout(self.rollout_actor.drain_trace.remote)  # a replaced worker's spans are lost
        parts = await asyncio.gather(rollout, *(a.drain_trace.remote() for a in self.trainer_actors))
        return [e for part in parts for e in part]

    async def save(self, path: str) -> None:
        await asyncio.gather(*(a.save.remote(path) for a in self.trainer_actors))  # rank 0 writes

    async def trained_ids(self) -> list[str]:
        return await self.trainer_actor.trained_ids.remote()  # rank 0 holds every rank's

    async def trained_samples(self, count: int) -> list[SampleSummary]:
        samples = await self.trainer_actor.trained_samples.remote(count)  # a few, as token ids
        self.driver_sample_bytes += pickled_size(samples)
        return samples  # type: ignore[no-any-return]

    async def save_state(self, path: str) -> None:
        await asyncio.gather(*(a.save_state.remote(path) for a in self.trainer_actors))  # fsdp2: a shard each

    async def load_state(self, path: str) -> int:
        versions = await asyncio.gather(*(a.load_state.remote(path) for a in self.trainer_actors))
        return versions[0]

    async def fingerprints(self) -> tuple[tuple[int, float], tuple[int, float]]:
        """((trainer version, checksum), (engine version, checksum)), each from its own actor; every
        data-parallel rank must hold rank 0's weights."""
        engine, *ranks = await asyncio.gather(
            self._on_rollout(self.rollout_actor.weights_fingerprint.remote),
            *(a.weights_fingerprint.remote() for a in self.trainer_actors),
        )
        if any(r != ranks[0] for r in ranks):
            raise RuntimeError(f"data-parallel trainer ranks diverged: (version, checksum) per rank {ranks}")
        return ranks[0], engine

    def heartbeats(self) -> list[Heartbeat]:
        """Every worker actor, pinged in its ``health`` concurrency group (answered even while it
        trains or generates); the rollout worker is replaceable where Ray restarts it
        (``rollout_restarts_allowed``; a multi-controller run's lost worker ends the run, named)."""
        from ray.exceptions import ActorDiedError

        def dead(err: BaseException) -> str | None:
            return death_detail(err) if isinstance(err, ActorDiedError) else None

        def ping(actor: Any) -> Callable[[], Awaitable[object]]:
            return lambda: actor.heartbeat.options(concurrency_group=HEALTH).remote()

        async def replace_rollout() -> None:
            import ray

            ray.kill(self.rollout_actor, no_restart=False)  # Ray restarts it; its waves raise WorkerLost

        beats = []
        for name, actor in self._named_actors():
            replace = replace_rollout if actor is self.rollout_actor and self.rollout_restarts_allowed else None
            beats.append(Heartbeat(name, self.answers.timed(name, ping(actor)), dead, replace))
        return beats

    def _named_actors(self) -> list[tuple[str, Any]]:
        """This pipeline's actors with their names (the heartbeats' and deaths'): the workers, the
        queue's storage units and controllers, the weight registries."""
        named = [("rollout worker", self.rollout_actor)]
        for rank, actor in enumerate(self.trainer_actors):
            named.append((f"trainer (rank {rank})" if self.spec.ranks > 1 else "trainer", actor))
        named += self._named_node_workers()
        units = self.queue.units
        unit_names = [f"queue storage unit {k}" if len(units) > 1 else "queue storage unit" for k in range(len(units))]
        named += list(zip(unit_names, units, strict=True))
        named += [(f"queue controller of task '{task}'", ctl) for task, ctl in self.queue_controllers.items()]
        for what, sync in (("weight registry", self.weight_sync), ("critic weight registry", self.critic_sync)):
            if isinstance(sync, ObjectStoreWeightSync):  # a broadcast group has no registry actor
                named.append((what, sync.actor()))
        return named

    def _named_node_workers(self) -> list[tuple[str, Any]]:
        nodes = placement(self.spec).node_workers
        return [(f"'{node.id}' task worker", actor) for node, actor in zip(nodes, self.node_actors, strict=True)]

    def end_records(self) -> dict[str, dict[str, float]]:
        """The sample bytes that passed through the driver (``driver``), and each storage unit's
        written rows and bytes and its process's CPU seconds (``queue``)."""
        import ray

        units = ray.get([unit.stats.remote() for unit in self.queue.units])
        keys = ("rows_written", "bytes_written", "cpu_s")
        queue = {f"unit{k}_{key}": float(u[key]) for k, u in enumerate(units) for key in keys}
        return {"driver": {"sample_bytes": float(self.driver_sample_bytes)}, "queue": queue}

    def explain(self, err: BaseException) -> RunStopped | None:
        """The one line for an actor's death found in ``err``'s causes (``None``: not one)."""
        return explain_death(err, self._actor_names)

    def close(self) -> None:
        import ray

        for handle in (self.rollout_actor, *self.trainer_actors, *self.node_actors):
            if handle is not None:
                ray.kill(handle)
        # a stopped storage unit or controller (the watchdog named it) answers no close call
        silent = self.answers.silent(self.spec.config.run.stall_timeout_s)
        self.queue.shutdown(silent={actor for actor, name in self._actor_names.items() if name in silent})
        self.placement.close()
        for sync in (self.weight_sync, self.critic_sync):  # their registry actors, and the weights
            if isinstance(sync, ObjectStoreWeightSync):
                sync.shutdown()


class RayPipeline(RayWorkers):
    """``RayWorkers`` driven by pushed admission: the driver hands the rollout worker each wave's
    prompts and deals each step's groups to the trainer ranks by tokens (each to the rank with the
    fewest so far)."""

    def __init__(self, spec: PipelineSpec, prompts: PromptStream, address: str | None = None) -> None:
        super().__init__(spec, prompts, address)
        self._group_tokens: dict[int, int] = {}
        self._rank_tokens: list[int] = []
        self._step_groups = 0
        """Groups handed to the ranks this step: the next group's position in the step."""

    def next_prompt(self) -> PromptItem:
        return self.prompts.take(1)[0]

    async def rollout_wave(self, groups: Sequence[tuple[PromptItem, int]]) -> AsyncIterator[GroupReport]:
        """The rollout worker's reports; if it dies, ``WorkerLost`` with the groups it did not report."""
        from ray.exceptions import RayActorError

        self.driver_sample_bytes += pickled_size(list(groups))
        stream = self.rollout_actor.run_groups.options(num_returns="streaming").remote(list(groups))
        prompt_tokens = {gid: len(item.prompt_ids) for item, gid in groups}
        try:
            async for ref in stream:
                report: GroupReport = await ref
                # a group's training cost in the packed layout: its prompt once, then every response
                self._group_tokens[report.group_id] = prompt_tokens[report.group_id] + report.response_tokens
                prompt_tokens.pop(report.group_id)
                yield report
        except RayActorError:
            raise WorkerLost("rollout worker", list(prompt_tokens), self.recover_rollout) from None

    async def abort_groups(self, group_ids: list[int], reason: str) -> None:
        await self._on_rollout(lambda: self.rollout_actor.abort_groups.remote(group_ids, reason))

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
            abandon(running)  # cancelled with its awaiter (a stopped run): nothing left to print

    async def finish_step(self) -> dict[str, float]:
        """Every rank's optimizer step (they meet in the gradient all-reduce); rank 0 reports."""
        results = await asyncio.gather(*(a.finish_step.remote() for a in self.trainer_actors))
        return results[0]


def pickled_size(value: Any) -> int:
    """Bytes of ``value`` as Ray sends it by value (pickle protocol 5)."""
    import pickle

    return len(pickle.dumps(value, protocol=5))


async def _awaited(ref: Any) -> Any:
    return await ref


def _runtime(threads: int, oversubscribed: bool) -> dict[str, Any]:
    """An actor's environment: the real thread count goes to OpenMP (its Ray CPUs are placement
    bookkeeping, ``runtime/placement.py``)."""
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    env.update({var: os.environ[var] for var in (TAG_VAR, DRIVER_VAR) if var in os.environ})  # the run tag
    if oversubscribed:  # spinning OpenMP workers would steal cores from the other actor
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return {"runtime_env": {"env_vars": env}}


def ensure_ray(address: str | None) -> None:
    """Join ``address``, or start one local Ray instance sized for this machine (once per process).
    Ray's own driver log records propagate to the process's handlers instead of Ray's stderr
    handler (``telemetry/console.py`` puts them in the run's log). A SIGTERM handler installed
    before (the run's, ``runtime/preemption.py``), which ``ray.init`` replaces with its own, is
    put back."""
    import ray

    if ray.is_initialized():
        return
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    logging.getLogger("ray").propagate = True  # Ray's driver records go where the process's go
    if address:
        ray.init(address=address, log_to_driver=False, configure_logging=False)  # `sluice train`: run.log
    else:
        ray.init(
            address="local",
            num_cpus=max(2, os.cpu_count() or 2),
            include_dashboard=False,
            object_store_memory=512 * 1024**2,
            log_to_driver=False,
            configure_logging=False,
        )
    if callable(sigterm):  # a handler of this process's own (not the default): it stays in charge
        signal.signal(signal.SIGTERM, sigterm)

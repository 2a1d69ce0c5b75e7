"""Placement of the asynchronous pipeline's workers: the shared parts, and ``local`` (one process).

Both build the same three parts — a TransferQueue, one ``RolloutWorker``, one ``TrainerWorker`` —
plus a weight sync, and expose them through the ``Pipeline`` verbs the controller drives.
Queue tasks after generation get a worker of their own: the reference log-probs (KL term) and,
for PPO, the critic's values (with a second weight sync carrying the critic the trainer updates).
``local`` runs the rollout worker on the event loop and the trainer in a worker thread (torch
releases the GIL in its kernels, so they overlap); ``ray`` gives each role its own actor and
process (``runtime/ray_pipeline.py``). Nothing here decides what to run when.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.api import GroupReport, PromptItem, RewardFn, SamplingParams, WeightSync
from sluice.config import SluiceConfig
from sluice.config.data import EvalConfig
from sluice.config.fleet import FleetConfig
from sluice.dag.node_worker import NodeTaskWorker
from sluice.dag.planner import compile_dag
from sluice.dag.run_dag import DagPlacement, place_dag
from sluice.dag.spec import load_dag
from sluice.data import PromptStream
from sluice.queue import AsyncLocalQueue, LocalQueue
from sluice.queue.snapshot import groups_snapshot
from sluice.rewards.judge import JudgeSpec
from sluice.rewards.reward_model import RewardModelSpec
from sluice.rollout.agentic import EnvRolloutSpec
from sluice.rollout.evaluate import EvalResult
from sluice.rollout.worker import RolloutWorker
from sluice.runtime.supervision import Heartbeat
from sluice.schedule.failures import RunStopped
from sluice.telemetry.samples import SampleSummary
from sluice.trainer.ppo import CriticSpec
from sluice.trainer.sections import algorithm_of, critic_of
from sluice.trainer.worker import TRAIN_TASK, TrainerWorker
from sluice.weights import InProcessWeightSync

WEIGHT_POLL_S = 0.005


@dataclass(frozen=True)
class PipelineSpec:
    """What the workers are built from: the run's config sections and what the run resolved from
    them (picklable, so Ray actors can receive it). Each worker takes its own section."""

    config: SluiceConfig
    model_dir: Path
    reward: RewardFn
    params: SamplingParams
    dag: DagPlacement | None = None
    """The run's DAG over the workers: queue tasks, node workers, the reward column (``None``: the
    algorithm's built-in DAG)."""
    agentic: EnvRolloutSpec | None = None
    """Multi-turn episodes of an environment instead of single-turn groups (``rollout/agentic.py``)."""

    @property
    def ranks(self) -> int:
        return self.config.resources.trainer.ranks

    @property
    def rollout_threads(self) -> int:
        """The rollout worker's torch threads (``resources.rollout.threads``)."""
        return self._threads(self.config.resources.rollout.threads)

    @property
    def trainer_threads(self) -> int:
        """Each trainer rank's torch threads (``resources.trainer.threads``)."""
        return self._threads(self.config.resources.trainer.threads)

    def _threads(self, own: int) -> int:
        """``sync`` overlaps nothing, so each phase may take every thread of ``run.threads``."""
        run = self.config.run
        return (run.threads or os.cpu_count() or 1) if run.mode == "sync" else own

    @property
    def critic(self) -> CriticSpec | None:
        """PPO's critic: the ``values`` node's worker values rows with it, the trainer updates it."""
        return critic_of(self.config.trainer)


class _Pipeline:
    """The verbs shared by both placements; subclasses say how to call the workers."""

    queue: Any

    def __init__(self, spec: PipelineSpec, prompts: PromptStream) -> None:
        self.spec = spec
        self.prompts = prompts
        self.engine_version = 0

    async def queue_snapshot(self, group_ids: set[int]) -> dict[str, Any]:
        """The queue's plain-data state of ``group_ids``' rows, untrained (for a checkpoint)."""
        return groups_snapshot(await asyncio.to_thread(self.queue.snapshot), group_ids)

    async def queue_restore(self, state: dict[str, Any]) -> None:
        await asyncio.to_thread(self.queue.restore, state)

    def heartbeats(self) -> list[Heartbeat]:
        """Workers in other processes to supervise (none when every worker runs in this one)."""
        return []

    def end_records(self) -> dict[str, dict[str, float]]:
        """Records for ``metrics.jsonl`` at the run's end, by kind (none in one process)."""
        return {}

    def explain(self, err: BaseException) -> RunStopped | None:
        """The one line for a worker's death in ``err`` (``None``: not one; in-process workers do
        not die on their own)."""
        return None


class LocalPipeline(_Pipeline):
    """All workers in this process: rollout on the event loop, trainer in one worker thread."""

    def __init__(self, spec: PipelineSpec, prompts: PromptStream) -> None:
        if spec.ranks > 1:
            raise ValueError("resources.trainer.ranks > 1 needs run.backend: ray (one process per rank)")
        super().__init__(spec, prompts)
        self.queue = LocalQueue(free_consumed=True)  # a row is freed once every task read it
        for task, columns in queue_tasks(spec).items():
            self.queue.register_task(task, columns)
        self.weight_sync = InProcessWeightSync()
        critic_sync = InProcessWeightSync() if spec.critic is not None else None
        self.rollout_worker = RolloutWorker(**rollout_kwargs(spec, AsyncLocalQueue(self.queue)))
        self.trainer = TrainerWorker(**trainer_kwargs(spec, self.queue, self.weight_sync, critic_sync))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-trainer")
        self._inline_trainer = spec.config.run.mode == "sync"
        """``sync`` overlaps nothing, so the trainer runs on the event loop's thread, where the engines
        decode: one OpenMP team of ``run.threads`` for both (a second team in the trainer's thread
        spin-waits beside the first and oversubscribes the cores: measured 0.55x of one thread)."""
        nodes = placement(spec).node_workers
        self._node_tasks = ThreadPoolExecutor(max_workers=max(len(nodes), 1), thread_name_prefix="sluice-node")
        self._served: list[Future[int]] = []
        """Each serves its queue task until the queue closes (``close`` raises what one raised)."""
        for node in nodes:
            self._serve(NodeTaskWorker(node, self.queue, **node_worker_kwargs(spec, critic_sync)))

    def next_prompt(self) -> PromptItem:
        return self.prompts.take(1)[0]

    def _serve(self, worker: NodeTaskWorker) -> None:
        served = self._node_tasks.submit(worker.serve)
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
        mode = self.spec.config.rollout.weight_update
        metrics = await self.rollout_worker.load_version(self.weight_sync, version, mode)
        if metrics.pop("engine_version", -1.0) < version:
            await wait_engine_version(self.engine_stats, version)
        self.engine_version = version
        return metrics

    async def evaluate(self, items: Sequence[PromptItem], max_new_tokens: int, config: EvalConfig) -> EvalResult:
        return await self.rollout_worker.evaluate(items, max_new_tokens, config)

    async def engine_stats(self) -> dict[str, float]:
        return await self.rollout_worker.engine_stats()

    async def resize_rollout(self, change: int) -> int:
        return await self.rollout_worker.resize(change)

    async def trace_events(self) -> list[dict[str, Any]]:
        return self.rollout_worker.drain_trace() + self.trainer.drain_trace()

    async def save(self, path: str) -> None:
        await self._in_trainer(self.trainer.save, path)

    async def trained_ids(self) -> list[str]:
        return self.trainer.trained_ids()

    async def trained_samples(self, count: int) -> list[SampleSummary]:
        return self.trainer.trained_samples(count)

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
        self._node_tasks.shutdown(wait=True)
        for served in self._served:
            served.result()  # re-raises a column task's failure

    async def _in_trainer(self, fn: Any, *args: Any) -> Any:
        if self._inline_trainer:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)


async def wait_engine_version(engine_stats: Callable[[], Awaitable[dict[str, float]]], version: int) -> None:
    """``defer`` swaps only after the running sequences drain: wait until the engine holds ``version``."""
    while (await engine_stats())["version"] < version:
        await asyncio.sleep(WEIGHT_POLL_S)


def weight_syncs(
    fleet: FleetConfig, name: str, address: str | None = None, *, engine_ranks: int = 0, bucket_mb: int = 256
) -> tuple[WeightSync, WeightSync]:
    """(the trainer's, the rollout worker's) views of the run's weight transfer (``fleet.*``);
    ``address``: where a broadcast group meets (a free port on trainer rank 0's node; ``None``: on
    this node's loopback). ``engine_ranks`` > 0: the engines' own workers (that many, vLLM's)
    receive the broadcasts and the rollout worker gets their feed; else the rollout worker
    receives. Versions travel in buckets of ``bucket_mb`` MiB (``trainer.weight_bucket_mb``)."""
    from sluice.weights import BroadcastWeightSync, ObjectStoreWeightSync

    if fleet.weight_transfer == "broadcast":
        from sluice.trainer.rendezvous import free_tcp_address

        group = BroadcastWeightSync(
            address or free_tcp_address(),
            receivers=engine_ranks or 1,
            backend=fleet.broadcast_backend,
            timeout_s=fleet.broadcast_timeout_s,
            bucket_bytes=bucket_mb << 20,
        )
        return group.publisher(), (group.engines() if engine_ranks else group.receiver(1))
    sync = ObjectStoreWeightSync(name=name)
    return sync, sync


def engine_receivers(spec: PipelineSpec) -> int:
    """How many engine worker processes join the weight broadcast group themselves: vLLM's (one per
    tensor-parallel rank of each replica); 0 for engines the rollout worker feeds."""
    cfg = spec.config
    if cfg.rollout.engine != "vllm" or cfg.fleet.weight_transfer != "broadcast":
        return 0
    return cfg.resources.rollout.replicas * cfg.vllm.tensor_parallel_size


def placement(spec: PipelineSpec) -> DagPlacement:
    """The run's DAG placement, or the built-in DAG's for the spec's algorithm and critic."""
    if spec.dag is not None:
        return spec.dag
    name = ("ppo" if spec.critic is not None else "grpo") + (
        "_kl" if algorithm_of(spec.config.trainer).uses_reference else ""
    )
    return place_dag(compile_dag(load_dag(name)), TRAIN_TASK)


def queue_tasks(spec: PipelineSpec) -> dict[str, tuple[str, ...]]:
    """The queue's tasks and their input columns: ``train`` and one per node worker."""
    return dict(placement(spec).tasks)


def node_worker_kwargs(spec: PipelineSpec, critic_sync: WeightSync | None) -> dict[str, Any]:
    """What a ``NodeTaskWorker`` needs besides its node and queue (models are built in its process)."""
    return {
        "model_dir": spec.model_dir,
        "trainer": spec.config.trainer,
        "temperature": spec.config.rollout.temperature,
        "critic_sync": critic_sync,
        "threads": spec.trainer_threads,
    }


def rollout_kwargs(
    spec: PipelineSpec, queue: Any, replica_options: dict[str, Any] | None = None, weight_feed: Any = None
) -> dict[str, Any]:
    """``replica_options``: Ray options of the engine replica actors (their placement);
    ``weight_feed``: the broadcast group's ``EngineWorkersFeed`` when the engines' workers receive."""
    cfg = spec.config
    return {
        "model_dir": spec.model_dir,
        "queue": queue,
        "reward": spec.reward,
        "params": spec.params,
        "rollout": cfg.rollout,
        "resources": cfg.resources.rollout,
        "replica_options": replica_options,
        "run_seed": cfg.run.seed,
        "reward_config": cfg.reward,
        "fleet": cfg.fleet,
        "engine_options": cfg.engine_options(),
        "agentic": spec.agentic,
        "threads": spec.rollout_threads,
        "trace": cfg.run.trace,
        "trace_max_events": cfg.run.trace_max_events,
        "replica_timeout_s": cfg.run.stall_timeout_s / 2,  # before the loop's own watchdog
        "reward_model": reward_model_spec(cfg),
        "judge": judge_spec(cfg),
        "weight_feed": weight_feed,
        "check_weights": cfg.run.check_weights,
    }


def judge_spec(cfg: SluiceConfig) -> JudgeSpec | None:
    """The LLM judge (``reward.judge``), or ``None``."""
    r = cfg.reward
    if r.judge is None:
        return None
    return JudgeSpec(r.judge, r.judge_template, r.judge_parser, tuple(r.judge_choices.items()), r.judge_max_new_tokens)


def reward_model_spec(cfg: SluiceConfig) -> RewardModelSpec | None:
    """The reward model's workers (``reward.model``, ``resources.reward_model``): objects in the
    rollout worker's process with ``run.backend: local``, a Ray actor each with ``ray``."""
    if cfg.reward.model is None:
        return None
    res = cfg.resources.reward_model
    options = {"num_cpus": res.cpus if res.cpus is not None else 0, "num_gpus": res.gpus or 0}
    return RewardModelSpec(
        path=cfg.reward.model,
        token_budget=cfg.reward.model_token_budget,
        workers=res.workers,
        threads=res.threads,
        chat_template=cfg.data.chat_template,
        actors=cfg.run.backend == "ray",
        actor_options=tuple(options.items()),
        timeout_s=cfg.reward.model_timeout_s,
    )


def trainer_kwargs(spec: PipelineSpec, queue: Any, weight_sync: Any, critic_sync: Any = None) -> dict[str, Any]:
    return {
        "model_dir": spec.model_dir,
        "queue": queue,
        "weight_sync": weight_sync,
        "trainer": spec.config.trainer,
        "temperature": spec.config.rollout.temperature,
        "group_size": spec.config.rollout.group_size,
        "steps": spec.config.run.steps,
        "threads": spec.trainer_threads,
        "resources": spec.config.resources.trainer,
        "trace": spec.config.run.trace,
        "trace_max_events": spec.config.run.trace_max_events,
        "critic_sync": critic_sync,
        "reward_column": placement(spec).reward_column,
        "check_weights": spec.config.run.check_weights,
    }

"""The multi-controller placement of a run (``run.controller: multi``, DistFlow): workers run their own loops.

``resources.rollout.workers`` rollout workers (``dag/shard_rollout.py``) each load their own
shard of the prompts (``dag/loader.py``, from the run's prompt file: the driver passes a path,
never rows), take admission credits from the run's ``StepGate`` actor (``schedule/step_gate.py``:
a small call carrying no sample bytes), and write each group into its step's queue partition.
Each trainer rank reads its own shard of step ``v``'s partition through the queue's
token-balanced redistribution (``TrainerWorker.train_partition``), whatever the number of
rollout workers. ``MultiRayPipeline`` places those workers; ``PullAdmission`` is the loop's
admission strategy over them (``loop.py`` runs the one loop of every run):

    train step v (every rank reads its shard of partition v) → v + 1 → every engine loads v + 1
      (in the background under η; before the next step in ``sync``) → the gate opens v + 1's slots

The staleness rule, the fates and the ledger are the single controller's (the gate keeps a
``GroupLedger``). Not here: choosing groups for a step (a group's step is fixed by its credit),
redundant prompts, agentic episodes (each refused by the config with one line). A checkpoint is
the gate's cut, each shard's cursor at it and the prompts of the groups still generating.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from sluice.api import Credit, GroupReport
from sluice.config import ConfigError
from sluice.controller.cut import AsyncCut
from sluice.dag.loader import PromptFile
from sluice.dag.shard_rollout import RemoteCredits, ShardRolloutWorker
from sluice.dag.spec import DagNode
from sluice.data import PromptStream
from sluice.runtime.pipelines import PipelineSpec, rollout_kwargs, wait_engine_version
from sluice.runtime.ray_pipeline import RayWorkers, _awaited, _runtime
from sluice.runtime.ray_supervision import supervised
from sluice.runtime.supervision import abandon
from sluice.schedule.failures import FailureBudget, RunStopped
from sluice.schedule.ledger import GroupLedger
from sluice.schedule.staleness import StalenessGate
from sluice.schedule.step_gate import GateCut, StepGate

NODE_STOP_S = 5.0
"""How long the end of a run waits for the node workers' last step (done by then, unless stopped early)."""
STOP_TIMEOUT_S = 60.0
"""How long a failing run waits for its rollout workers to stop before it reports the failure."""


class MultiRayPipeline(RayWorkers):
    """``RayWorkers`` with ``resources.rollout.workers`` shard rollout workers and the
    step gate; the driver never moves a prompt or a row."""

    rollout_class = ShardRolloutWorker
    rollout_restarts_allowed = 0  # a restarted worker would have lost its loop: the run stops, named

    def __init__(self, spec: PipelineSpec, prompts: PromptStream, source: PromptFile, address: str | None = None):
        import ray

        from sluice.queue import AsyncRayQueue

        super().__init__(spec, prompts, address)
        cfg = spec.config
        self.source = source
        self.rows_per_step = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        kwargs = rollout_kwargs(spec, AsyncRayQueue(self.queue), self.placement.replica_options())
        runtime = _runtime(spec.rollout_threads, self.oversubscribed)
        options = {"num_cpus": self.actor_share, "max_restarts": 0, **runtime}
        extra_cls: Any = supervised(ShardRolloutWorker).options(**options)
        self.rollout_actors = [self.rollout_actor] + [
            extra_cls.remote(**{**kwargs, "name": f"rollout{r}"}) for r in range(1, 1 + self.extra_rollouts)
        ]
        self._actor_names = {a._actor_id.hex(): name for name, a in self._named_actors()}
        gate_cls: Any = ray.remote(StepGate).options(num_cpus=0, max_concurrency=64)
        failures = FailureBudget(cfg.run.failure_budget, cfg.run.failure_window)
        self.gate = gate_cls.remote(StalenessGate.of(cfg.rollout), cfg.run.steps, failures)
        self.cursors: list[dict[str, int]] = []
        """Each prompt shard's cursor at the end of the run (``stop_shards``)."""
        self.node_rows: dict[str, int] = {}
        """Rows each node worker rank served (``stop_shards``)."""
        self.shards: list[Any] = []
        """The rollout workers' ``run_shard`` calls (each returns its shard's cursor at the end)."""

    @staticmethod
    def node_actor_count(nodes: Sequence[DagNode]) -> int:
        """One actor per data-parallel rank of each node."""
        return sum(node.parallel for node in nodes)

    def _start_node_workers(
        self, nodes: Sequence[DagNode], node_cls: Any, kwargs: dict[str, Any]
    ) -> tuple[list[Any], list[Any]]:
        """``node.parallel`` actors per node after rollout; each serves its shard of every step
        from ``start_shards`` on."""
        self.node_ranks = [(node, rank) for node in nodes for rank in range(node.parallel)]
        return [node_cls.remote(node, self.queue, **kwargs) for node, _ in self.node_ranks], []

    def _named_node_workers(self) -> list[tuple[str, Any]]:
        ranks = zip(self.node_ranks, self.node_actors, strict=True)
        return [(f"'{node.id}' task worker {rank}", actor) for (node, rank), actor in ranks]

    def start_shards(self, resumed: AsyncCut | None = None) -> None:
        """Every rollout worker starts its own admission loop over its prompt shard; a resumed
        run's workers start at the cut's cursors, dealt the groups it had generating."""
        cfg, size = self.spec.config, len(self.rollout_actors)
        per_call = max(1, cfg.rollout.prompts_per_step // size)
        credits = RemoteCredits(self.gate)
        cursors: list[dict[str, int] | None] = list(resumed.shards) if resumed else [None] * size
        if len(cursors) != size:
            raise ConfigError(f"resources.rollout.workers: the checkpoint has {len(cursors)} prompt shards, not {size}")
        again = [(item, Credit(gid, resumed.steps[gid], 0)) for item, gid in resumed.regenerate] if resumed else []
        self.shards = [
            actor.run_shard.remote(
                credits, self.source, rank, size, seed=cfg.run.seed, rows_per_step=self.rows_per_step,
                per_call=per_call, cursor=cursors[rank], regenerate=again[rank::size],
            )
            for rank, actor in enumerate(self.rollout_actors)
        ]  # fmt: skip
        first = self.engine_version  # a resumed run's first untrained step
        self._served = [
            actor.serve_steps.remote(rank, node.parallel, self.rows_per_step, first, cfg.run.steps)
            for (node, rank), actor in zip(self.node_ranks, self.node_actors, strict=True)
        ]

    async def cut(self, trained_steps: int) -> AsyncCut:
        """The books at a step boundary: the gate's (one consistent cut), every shard's cursor at
        it and the prompts of the groups still generating (restarted on resume)."""
        gate: GateCut = await self.gate.cut.remote()
        pending = sorted(gate.pending)
        parts = await asyncio.gather(
            *(a.checkpoint_cut.remote(gate.next_group, trained_steps, pending) for a in self.rollout_actors)
        )
        prompts = {gid: item for _, found in parts for gid, item in found.items()}
        reports = {r.group_id: r for filled in gate.filled.values() for r in filled}
        steps = {r.group_id: step for step, filled in gate.filled.items() for r in filled} | gate.pending
        regenerate = [(prompts[gid], gid) for gid in pending]
        return AsyncCut(gate.next_group, gate.ledger, reports, regenerate, steps=steps, shards=[c for c, _ in parts])

    async def restore_gate(self, cut: AsyncCut, version: int) -> None:
        """The gate continues from ``cut`` (taken after step ``version``)."""
        filled: dict[int, list[GroupReport]] = {}
        for gid, report in sorted(cut.reports.items()):
            filled.setdefault(cut.steps[gid], []).append(report)
        pending = {gid: cut.steps[gid] for _, gid in cut.regenerate}
        gate = GateCut(cut.ledger, cut.next_group, version, filled, pending)
        await self.gate.restore.remote(gate, self.engine_version)

    async def train_step(self, step: int) -> dict[str, float]:
        """Every trainer rank trains its shard of partition ``step`` (rank 0 reports). A worker
        that fails meanwhile ends the step with its error; a rollout loop must not end at all (a
        node worker ends normally after the run's last step)."""
        timeout = self.spec.config.run.stall_timeout_s
        ranks = [a.train_partition.remote(step, self.rows_per_step, timeout) for a in self.trainer_actors]
        training = asyncio.ensure_future(asyncio.gather(*ranks))
        rollouts = {asyncio.ensure_future(_awaited(ref)) for ref in self.shards}
        watched = rollouts | {asyncio.ensure_future(_awaited(ref)) for ref in self._served}
        try:
            while not training.done():
                done, _ = await asyncio.wait([training, *watched], return_when=asyncio.FIRST_COMPLETED)
                for ended in done - {training}:
                    _raise_cause(ended)  # its error; a failure budget's stop as its one line
                    if ended in rollouts:
                        raise RuntimeError("a rollout worker's loop ended while the trainer waited for its rows")
                    watched.discard(ended)
            results = await training
        finally:
            for task in watched:
                task.cancel()
            abandon(training)  # cancelled with its awaiter (a stopped run): nothing left to print
        return dict(results[0])

    async def step_reports(self, step: int) -> list[GroupReport]:
        timeout = self.spec.config.run.stall_timeout_s
        return await self.gate.step_reports.remote(step, timeout)  # type: ignore[no-any-return]

    async def sync_weights(self, version: int) -> dict[str, float]:
        """Every rollout worker loads ``version``; then the gate grants slots under it."""
        sync, mode = self.engine_weight_sync, self.spec.config.rollout.weight_update
        loads = await asyncio.gather(*(a.load_version.remote(sync, version, mode) for a in self.rollout_actors))
        behind = [a for a, m in zip(self.rollout_actors, loads, strict=True) if m.get("engine_version", -1.0) < version]
        await asyncio.gather(*(wait_engine_version(a.engine_stats.remote, version) for a in behind))
        self.engine_version = max(self.engine_version, version)
        await self.gate.advance.remote(version)
        return {k: max(m.get(k, 0.0) for m in loads) for k in ("weight_fetch_s", "weight_load_s")}

    async def stop_shards(self) -> GroupLedger:
        """No more credits; groups still generating are aborted (``run_end``); the run's books."""
        await self.gate.close.remote()
        await asyncio.gather(*(a.stop_shard.remote() for a in self.rollout_actors))
        cursors = await asyncio.gather(*(_awaited(ref) for ref in self.shards), return_exceptions=True)
        self.cursors = [c for c in cursors if isinstance(c, dict)]
        served = [asyncio.ensure_future(_awaited(ref)) for ref in self._served]
        if served:  # after the last step they are done; a run stopped early leaves them waiting
            await asyncio.wait(served, timeout=NODE_STOP_S)
        names = [f"{node.id}{rank}" for node, rank in self.node_ranks]
        rows = [t.result() if t.done() and t.exception() is None else None for t in served]
        self.node_rows = {name: n for name, n in zip(names, rows, strict=True) if n is not None}
        for task in served:
            task.cancel()
        return await self.gate.books.remote()  # type: ignore[no-any-return]

    async def trace_events(self) -> list[dict[str, Any]]:
        parts = await asyncio.gather(*(a.drain_trace.remote() for a in [*self.rollout_actors, *self.trainer_actors]))
        return [e for part in parts for e in part]

    async def engine_stats(self) -> dict[str, float]:
        """Every rollout worker's counters added; medians and means averaged; ``version``: the
        oldest any holds."""
        parts = await asyncio.gather(*(a.engine_stats.remote() for a in self.rollout_actors))
        keys = {k for p in parts for k in p}
        total = {k: sum(p.get(k, 0.0) for p in parts) for k in keys}
        averaged = {k: total[k] / len(parts) for k in keys if k.endswith(("median", "mean"))}
        return {**total, **averaged, "version": min(p["version"] for p in parts)}

    async def fingerprints(self) -> tuple[tuple[int, float], tuple[int, float]]:
        """As ``RayWorkers``', and every rollout worker must hold the first one's weights."""
        trainer, engine = await super().fingerprints()
        others = await asyncio.gather(*(a.weights_fingerprint.remote() for a in self.rollout_actors[1:]))
        if any(o != engine for o in others):
            raise RuntimeError(f"rollout workers hold different weights: (version, checksum) {[engine, *others]}")
        return trainer, engine

    def end_records(self) -> dict[str, dict[str, float]]:
        """As ``RayWorkers``', and where each worker's prompt shard stands (``shards``)."""
        cursors = {f"shard{c['rank']}_{k}": float(c[k]) for c in self.cursors for k in ("epoch", "position")}
        rows = {f"node_rows_{k}": float(v) for k, v in self.node_rows.items()}
        return {**super().end_records(), "shards": {**cursors, **rows}}

    def _named_actors(self) -> list[tuple[str, Any]]:
        named = super()._named_actors()
        extra = getattr(self, "rollout_actors", [None])[1:]  # none yet while ``RayWorkers`` builds
        return named + [(f"rollout worker {r}", a) for r, a in enumerate(extra, start=1)]

    def close(self) -> None:
        import ray

        for handle in (*self.rollout_actors[1:], self.gate):
            ray.kill(handle)
        super().close()


class PullAdmission:
    """Pull admission (``Admission``): rollout workers take credits from the run's ``StepGate``
    actor and write each group to its step's partition; every trainer rank reads its shard of
    the step. The driver admits nothing and chooses nothing; the gate keeps the books."""

    def __init__(self, pipeline: MultiRayPipeline, gate: StalenessGate, *, barrier: bool) -> None:
        self.pipeline = pipeline
        self.barrier = barrier
        self.ledger = GroupLedger(gate)
        """The run's books: the gate's, fetched when the run stops (empty until then)."""
        self.reports: dict[int, GroupReport] = {}
        """The reports of the step being logged."""
        self.reported = 0  # the workers report to the gate, not to the driver
        self._trained = pipeline.engine_version
        self._resumed: AsyncCut | None = None

    async def start(self, steps: int) -> None:
        self.pipeline.start_shards(self._resumed)

    async def train_step(self, version: int) -> tuple[list[int], dict[str, float]]:
        metrics = await self.pipeline.train_step(version)  # every rank, its own shard
        self.reports = {r.group_id: r for r in await self.pipeline.step_reports(version)}
        self._trained = version + 1
        return list(self.reports), metrics

    def logged(self, chosen: list[int]) -> None:
        self.reports = {}

    async def before_sync(self, version: int) -> bool:
        return False  # the gate opens the new version's slots once every engine holds it

    def opened(self) -> None:
        pass  # ``MultiRayPipeline.sync_weights`` advanced the gate

    async def stop(self, failed: bool) -> None:
        """No more credits; the books (after a failure: so far, if the workers still answer)."""
        if not failed:
            self.ledger = await self.pipeline.stop_shards()
            return
        with contextlib.suppress(Exception):
            self.ledger = await asyncio.wait_for(self.pipeline.stop_shards(), STOP_TIMEOUT_S)

    async def cut(self) -> AsyncCut:
        return await self.pipeline.cut(self._trained)

    async def resume(self, cut: AsyncCut, version: int) -> None:
        """Continue a checkpointed run from ``cut``, taken after step ``version``."""
        await self.pipeline.restore_gate(cut, version)
        self._trained, self._resumed = version, cut


def _raise_cause(ended: asyncio.Future[Any]) -> None:
    from ray.exceptions import RayTaskError

    try:
        ended.result()
    except RayTaskError as err:
        if isinstance(err.cause, RunStopped):
            raise err.cause from None
        raise

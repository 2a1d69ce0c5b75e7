"""The rollout worker: inference replicas behind an ``LLMProxy``, the workflow, the reward —
writing groups to the queue.

Its ``GroupRunner`` generates each prompt group, scores it, applies the dynamic filter and writes
the surviving samples to the TransferQueue as each group completes (queue or batch scheduling);
only a small ``GroupReport`` goes back to the controller (data never passes through the driver).
The ``resources.rollout.replicas`` engines live in this process and share its torch threads, or
with ``resources.rollout.replica_actors`` each in its own Ray actor (``EngineHost``), driven
through the proxy, which replaces a replica actor that dies (``ENGINE_REPLACEMENTS`` times at
most). The same class runs in-process (``backend: local``) or as a Ray actor (``backend: ray``). It does not
decide admission, quotas or versions: the controller does. With an ``EnvRolloutSpec`` (the
``agentic`` section) its runner is an ``EnvRunner`` instead: groups of multi-turn episodes
against an environment, evaluated by greedy episodes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from sluice.api import (
    AsyncQueueClient,
    ExpectsRequests,
    GroupReport,
    Partition,
    PromptItem,
    RewardFn,
    SamplingParams,
    WeightSync,
)
from sluice.config import ConfigError
from sluice.config.data import EvalConfig
from sluice.config.fleet import FleetConfig
from sluice.config.models import RewardConfig, RolloutConfig
from sluice.config.resources import RolloutResources
from sluice.engines import build_inference_engine
from sluice.engines.hf_model import load_tokenizer
from sluice.rewards import build_model_reward, build_reward_service, no_rule_reward, overlong_shaping
from sluice.rewards.judge import JudgeSpec
from sluice.rewards.reward_model import RewardModelSpec
from sluice.rollout.agent_runner import AgentEpisodeRunner
from sluice.rollout.agent_session import ExpectedCalls
from sluice.rollout.agentic import EnvRolloutSpec, build_env_runner, evaluate_episodes
from sluice.rollout.env_runner import EnvRunner
from sluice.rollout.evaluate import EvalResult, evaluate_async
from sluice.rollout.filters import FILTERS
from sluice.rollout.groups import GroupRunner
from sluice.rollout.length_ranker import OnlineLengthRanker
from sluice.rollout.model_ranker import SequenceLengthRanker
from sluice.rollout.proxy import LLMProxy
from sluice.rollout.replicas import (
    LocalReplica,
    RayReplica,
    engine_fingerprint,
    start_engine_actors,
    watch_replicas,
)
from sluice.rollout.single_turn import SingleTurnWorkflow
from sluice.rollout.skew_dispatch import long_tail_split
from sluice.telemetry.trace import SpanRecorder
from sluice.weights.broadcast import EngineWorkersFeed

LENGTH_RANKERS = {"ridge": OnlineLengthRanker, "model": SequenceLengthRanker}
"""``fleet.length_ranker``: the ``LengthPredictor`` behind longest-predicted-first dispatch."""

ENGINE_REPLACEMENTS = 3
"""How many dead replica actors (``resources.rollout.replica_actors``) a run replaces; the next
death is the proxy's to handle with the replicas left."""


CHECK_POLL_S = 0.01
"""``run.check_weights``: how often a load waits to see every replica hold the new version."""


class RolloutWorker:
    """Generates, scores and stores prompt groups with ``replicas`` engines behind one proxy."""

    def __init__(
        self,
        model_dir: str | Path,
        queue: AsyncQueueClient,
        reward: RewardFn,
        params: SamplingParams,
        rollout: RolloutConfig,
        *,
        resources: RolloutResources | None = None,
        replica_options: Mapping[str, Any] | None = None,
        run_seed: int,
        reward_config: RewardConfig,
        fleet: FleetConfig,
        engine_options: Mapping[str, Any],
        agentic: EnvRolloutSpec | None = None,
        threads: int = 1,
        trace: bool = True,
        trace_max_events: int | None = None,
        replica_timeout_s: float | None = None,
        weight_feed: EngineWorkersFeed | None = None,
        check_weights: bool = False,
        name: str = "rollout",
        reward_model: RewardModelSpec | None = None,
        judge: JudgeSpec | None = None,
    ) -> None:
        self.check_weights = check_weights
        """Report the engines' checksum of each version loaded (``run.check_weights``)."""
        torch.set_num_threads(threads)  # shared by every replica in this process
        self.reward = build_reward_service(reward_config, reward)  # first: a reward that cannot run stops here
        self.model_reward = build_model_reward(reward_config, reward_model, judge)
        penalty = overlong_shaping(reward_config, params.max_new_tokens)
        if penalty is not None and agentic is not None:
            raise ConfigError("reward.overlong_buffer: single-turn rollouts only (an environment scores its episodes)")
        self.tokenizer = load_tokenizer(model_dir)
        self.engines: list[Any] = []
        self.resources = resources = resources or RolloutResources()
        """Replica count and placement (``resources.rollout``; ``replica_options``: the Ray options
        of replica actors, where the pipeline placed them)."""
        self.weight_feed = weight_feed
        """Set when the engines' own workers receive each version from the broadcast group."""
        self.proxy = self._start_replicas(model_dir, rollout, fleet, engine_options, threads, replica_options)
        self.fleet = fleet
        self._replica_timeout_s = replica_timeout_s if resources.replica_actors else None
        self._replica_watch: asyncio.Task[None] | None = None
        self._watch_counts: dict[str, float] = {}
        if not params.stop_token_ids:
            params = SamplingParams(
                params.max_new_tokens, params.temperature, params.top_p, (self.tokenizer.eos_token_id,)
            )
        self.params = params
        self.group_size = group_size = rollout.group_size
        self.run_seed = run_seed
        self.tracer = SpanRecorder(name, enabled=trace, max_events=trace_max_events)
        self.env_runner: EnvRunner | None = None
        self.runner: GroupRunner | EnvRunner
        if agentic is not None:  # multi-turn: episodes of an environment
            self.runner = self.env_runner = build_env_runner(
                agentic, self.proxy, queue, self.tokenizer, params, group_size=group_size, run_seed=run_seed,
                model_dir=model_dir, tracer=self.tracer, reward=self.reward,
            )  # fmt: skip
            if isinstance(self.env_runner.episodes, AgentEpisodeRunner):  # engines may wait for its calls
                self._expect_calls(self.env_runner.episodes.expected, agentic.hold_for_calls)
        else:
            workflow = SingleTurnWorkflow(self.tokenizer, params, group_size, run_seed, penalty)
            self.runner = GroupRunner(
                self.proxy,
                workflow,
                queue,
                self.reward if reward_config.combine == "sum" else no_rule_reward,  # model: the RM alone
                group_filter=FILTERS[rollout.filter_groups],
                scheduling=rollout.scheduling,
                tracer=self.tracer,
                model_reward=self.model_reward,
            )

    def _expect_calls(self, expected: ExpectedCalls, hold: float) -> None:
        """Engines in this process wait for agent calls on their way (``agentic.hold_for_calls``);
        each expects its share (the proxy spreads episodes over the replicas)."""
        share = len(self.engines)
        for engine in self.engines:
            if isinstance(engine, ExpectsRequests):
                engine.expect_requests(lambda: expected() / share, hold)

    def _start_replicas(
        self,
        model_dir: str | Path,
        rollout: RolloutConfig,
        fleet: FleetConfig,
        engine_options: Mapping[str, Any],
        threads: int,
        replica_options: Mapping[str, Any] | None,
    ) -> LLMProxy:
        """``resources.rollout.replicas`` engines (in this process, or ``EngineHost`` actors that the
        proxy replaces when one dies) behind the proxy."""
        engine, max_batch = rollout.engine, rollout.max_batch

        def engine_actors(count: int) -> list[Any]:
            if self.weight_feed is not None:  # each its own ranks in the broadcast group
                return [actor for i in range(count) for actor in engine_actors_at(i)]
            return start_engine_actors(
                count, engine, str(model_dir), max_batch=max_batch, options=engine_options, threads=threads,
                placement=replica_options,
            )  # fmt: skip

        def engine_actors_at(index: int) -> list[Any]:
            return start_engine_actors(
                1, engine, str(model_dir), max_batch=max_batch, options=self._options(engine_options, index),
                threads=threads, placement=replica_options,
            )  # fmt: skip

        def new_engines(count: int) -> list[Any]:
            """``count`` engines: at the start, or one more (a replacement, ``fleet.rebalance``; neither
            with a broadcast group, whose ranks are fixed when it meets)."""
            if self.resources.replica_actors:
                return engine_actors(count)
            return [
                build_inference_engine(engine, model_dir, max_batch=max_batch, options=self._options(engine_options, i))
                for i in range(count)
            ]

        async def replacement() -> Any:
            self.engines += new_engines(1)
            return self.engines[-1]

        actors = self.resources.replica_actors
        self._new_engine = replacement
        self.engines = new_engines(self.resources.replicas)
        return LLMProxy(
            self.engines,
            prompt_replication=rollout.prompt_replication,
            stagger=rollout.stagger,
            length_predictor=(LENGTH_RANKERS[fleet.length_ranker]() if fleet.lpt else None),
            slots=max_batch,
            long_tail=long_tail_split(fleet, max_batch),
            replace=replacement if actors and self.weight_feed is None else None,  # a new one could not join
            replacements=ENGINE_REPLACEMENTS,
        )

    async def resize(self, change: int) -> int:
        """Add (``change`` > 0) or remove (< 0) that many replicas while groups generate
        (``fleet.rebalance``): a newcomer loads the newest weights before the proxy routes to it; a
        leaving one's requests continue on the others from their partial responses, then its actor
        is stopped. Returns the replicas now."""
        for _ in range(change):
            await self.proxy.add_replica(await self._new_engine())
        for _ in range(-change):
            replica = self.proxy.replicas[-1]
            await self.proxy.remove_replica(self.proxy.replica_ids[-1])
            self._stop_engine(replica)
        return len(self.proxy.replica_ids)

    def _stop_engine(self, replica: Any) -> None:
        """Forget a removed replica's engine (an actor is killed; an in-process one is dropped)."""
        if isinstance(replica, RayReplica):
            import ray

            self.engines.remove(replica.handle)
            ray.kill(replica.handle)
        elif isinstance(replica, LocalReplica):
            self.engines.remove(replica.engine)

    def _options(self, engine_options: Mapping[str, Any], replica: int) -> Mapping[str, Any]:
        """Replica ``replica``'s engine options: with a ``weight_feed`` its workers' place in the
        broadcast group (ranks ``1 + replica * tensor_parallel_size`` on)."""
        if self.weight_feed is None:
            return engine_options
        ranks = int(engine_options.get("tensor_parallel_size", 1))
        return {**engine_options, "weight_group": self.weight_feed.worker_group(1 + replica * ranks)}

    async def run_groups(
        self, groups: Sequence[tuple[PromptItem, int]], partitions: Mapping[int, Partition] | None = None
    ) -> AsyncIterator[GroupReport]:
        """Start a wave of groups together, then report each as it completes (``GroupRunner``);
        ``partitions``: each group's queue partition (single-turn groups only)."""
        self._watch_replicas()
        if partitions and not isinstance(self.runner, GroupRunner):
            raise ConfigError("run.controller=multi: single-turn groups only (no agentic section)")
        stream = self.runner.run_groups(groups, partitions) if partitions else self.runner.run_groups(groups)
        async for report in stream:
            yield report

    def abort_groups(self, group_ids: Sequence[int], reason: str) -> None:
        """Stop groups that became surplus; each reports itself discarded with ``reason``."""
        self.runner.abort_groups(group_ids, reason)

    async def run_group(self, item: PromptItem, group_id: int) -> GroupReport:
        self._watch_replicas()
        return await self.runner.run_group(item, group_id)

    async def load_version(self, sync: WeightSync, version: int, mode: str) -> dict[str, float]:
        """Fetch ``version`` from the weight sync and push it to the replicas (``interrupt`` |
        ``defer`` | ``staggered``), then wait until they all hold it; returns how long fetching and
        handing it over took (an ``interrupt`` load stalls generation for the latter) and the
        version the replicas hold (``engine_version``)."""
        start = time.perf_counter()
        with self.tracer.span("weight_fetch", lane="weights", version=version):
            weights = sync.fetch(version)
        fetched = time.perf_counter()
        with self.tracer.span("weight_sync", lane="weights", version=version, mode=mode):
            await self.proxy.sync_weights(weights, version, mode)  # type: ignore[arg-type]
        loaded = time.perf_counter()
        held = await self.proxy.settled()  # here, not polled over Ray calls: each waits for a decode step
        metrics = {"weight_fetch_s": fetched - start, "weight_load_s": loaded - fetched, "engine_version": held}
        if self.check_weights:  # once every replica holds it (defer: after its drain)
            while self.proxy.stats()["version"] < version:
                await asyncio.sleep(CHECK_POLL_S)
            held_version, checksum = await self.weights_fingerprint()
            metrics.update(engine_version=float(held_version), engine_checksum=checksum)
        return metrics

    async def evaluate(self, items: Sequence[PromptItem], max_new_tokens: int, config: EvalConfig) -> EvalResult:
        """Greedy (and ``config.samples`` sampled) responses to ``items`` with the current weights,
        scored by the run's reward; an ``eval`` span on the timeline."""
        with self.tracer.span("eval", lane="eval", prompts=len(items), samples=config.samples) as span:
            if self.env_runner is not None:  # greedy episodes, success = reward >= 1
                result = await evaluate_episodes(self.env_runner.episodes, list(items), config)
            else:
                result = await evaluate_async(
                    self.proxy, items, self.tokenizer, self.reward, max_new_tokens, config, seed=self.run_seed
                )
            span.set(prompts=result.count, accuracy=result.accuracy)
            return result

    async def engine_stats(self) -> dict[str, float]:
        """Every replica's counters merged, the proxy's (``proxy_*``: routing, moves) and the reward
        service's (``reward_*``)."""
        proxy = {f"proxy_{k}": v for k, v in self.proxy.stats().items() if k not in ("version", "pending_version")}
        proxy.update({f"proxy_{k}": v for k, v in self._watch_counts.items()})
        episodes = self.env_runner.stats() if self.env_runner is not None else {}
        model = self.model_reward.stats() if self.model_reward is not None else {}
        return {**await self.proxy.engine_stats(), **proxy, **self.reward.stats(), **model, **episodes}

    async def weights_fingerprint(self) -> tuple[int, float]:
        """(oldest version a replica holds, float64 sum of the parameters, which all replicas share)."""
        prints = await asyncio.gather(*(engine_fingerprint(replica) for replica in self.proxy.replicas))
        sums = {checksum for version, checksum in prints if version == prints[0][0]}
        assert len(sums) == 1, f"replicas holding one version disagree on its weights: {sums}"
        return min(version for version, _ in prints), sums.pop()

    def _watch_replicas(self) -> None:
        """Start watching the replica actors' heartbeats (on this event loop, once)."""
        if self._replica_timeout_s is not None and self._replica_watch is None:
            watch = watch_replicas(lambda: self.proxy.replicas, self._replica_timeout_s, self._watch_counts)
            self._replica_watch = asyncio.get_running_loop().create_task(watch)

    def drain_trace(self) -> list[dict[str, Any]]:
        return self.tracer.drain()

    def close(self) -> None:
        """Stop the reward processes and replica actors (a killed Ray actor's reward processes and
        the actors it owns end on their own)."""
        self.reward.close()
        if self.model_reward is not None:
            self.model_reward.close()
        if self.env_runner is not None:  # an agent runner's endpoint and event loop
            self.env_runner.episodes.close()
        if self.resources.replica_actors:
            import ray

            for handle in self.engines:
                ray.kill(handle)
        else:  # engines in this process that run their own (vLLM's engine core and workers)
            for engine in self.engines:
                if callable(getattr(engine, "close", None)):
                    engine.close()

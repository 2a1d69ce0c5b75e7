"""The rollout worker: one inference engine, the workflow, the reward — writing groups to the queue.

``run_group`` generates a prompt group, scores it, applies the dynamic filter and writes the
surviving samples to the TransferQueue as each group completes; it returns only a small
``GroupReport`` to the controller (data never passes through the driver). The same class runs
in-process (``backend: local``) or as a Ray actor (``backend: ray``). It does not decide
admission or versions: the controller does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch

from sluice.api import AsyncQueueClient, GroupReport, PromptItem, RewardFn, SamplingParams, WeightSync
from sluice.config.models import RewardConfig
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm, load_tokenizer
from sluice.queue.samples import samples_to_rows
from sluice.rewards import build_reward_service
from sluice.rollout.evaluate import EvalResult, evaluate_async
from sluice.rollout.filters import GroupFilter, reward_failure
from sluice.rollout.single_turn import SingleTurnWorkflow
from sluice.telemetry.trace import SpanRecorder


class RolloutWorker:
    """Generates, scores and stores prompt groups with one engine."""

    def __init__(
        self,
        model_dir: str | Path,
        queue: AsyncQueueClient,
        reward: RewardFn,
        params: SamplingParams | None,
        group_size: int,
        *,
        run_seed: int,
        max_batch: int,
        group_filter: GroupFilter | None = None,
        reward_config: RewardConfig | None = None,
        threads: int = 1,
        trace: bool = True,
        name: str = "rollout",
    ) -> None:
        torch.set_num_threads(threads)
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = HFInferenceEngine(load_causal_lm(model_dir), max_batch=max_batch)
        if params is not None and not params.stop_token_ids:
            params = SamplingParams(
                params.max_new_tokens, params.temperature, params.top_p, (self.tokenizer.eos_token_id,)
            )
        self.params = params
        self.workflow = SingleTurnWorkflow(self.tokenizer, params, group_size, run_seed) if params else None
        self.queue = queue
        self.reward = build_reward_service(reward_config or RewardConfig(), reward)
        self.group_size = group_size
        self.group_filter = group_filter
        self.tracer = SpanRecorder(name, enabled=trace)

    async def run_groups(self, groups: Sequence[tuple[PromptItem, int]]) -> AsyncIterator[GroupReport]:
        """Start a wave of groups together, then report each as it completes (completion order).

        Submitting a whole admission wave before the engine takes its next step makes the
        engine's batches independent of message timing, so a wave reproduces the sync loop's
        batches exactly.
        """
        tasks = [asyncio.ensure_future(self.run_group(item, gid)) for item, gid in groups]
        try:
            for done in asyncio.as_completed(tasks):
                yield await done
        finally:
            for task in tasks:
                task.cancel()

    async def run_group(self, item: PromptItem, group_id: int) -> GroupReport:
        assert self.workflow is not None, "worker built without sampling params"
        with self.tracer.span("generate", lane=f"group{group_id % 8}", group=group_id):
            samples = await self.workflow.run(item, group_id, self.engine, self.reward)
        reason = reward_failure(samples) or (self.group_filter(samples) if self.group_filter else None)
        if reason is None:
            indices, columns, meta = samples_to_rows(samples, self.group_size)
            with self.tracer.span("queue_put", lane="queue", group=group_id):
                await self.queue.put(indices, columns, meta)
        return GroupReport(
            group_id=group_id,
            version=min(s.version for s in samples),
            num_samples=len(samples),
            response_tokens=sum(len(s.response_ids) for s in samples),
            rewards=tuple(s.reward for s in samples),
            discard_reason=reason,
            finished_at=time.time(),
        )

    def load_version(self, sync: WeightSync, version: int, mode: str) -> dict[str, float]:
        """Fetch ``version`` from the weight sync and hand it to the engine (``interrupt`` |
        ``defer`` | ``staggered``); returns how long fetching and loading took."""
        start = time.perf_counter()
        with self.tracer.span("weight_fetch", lane="weights", version=version):
            weights = sync.fetch(version)
        fetched = time.perf_counter()
        with self.tracer.span("weight_sync", lane="weights", version=version, mode=mode):
            self.engine.update_weights(weights, version, mode)  # type: ignore[arg-type]
        return {"weight_fetch_s": fetched - start, "weight_load_s": time.perf_counter() - fetched}

    async def evaluate(self, items: Sequence[PromptItem], max_new_tokens: int) -> EvalResult:
        with self.tracer.span("eval", lane="eval", prompts=len(items)):
            return await evaluate_async(self.engine, items, self.tokenizer, self.reward, max_new_tokens)

    def engine_stats(self) -> dict[str, float]:
        """The engine's counters and the reward service's (``reward_*``)."""
        return {**self.engine.stats(), **self.reward.stats()}

    def weights_fingerprint(self) -> tuple[int, float]:
        """(version the engine holds, float64 sum of its parameters)."""
        return self.engine.version, self.engine.weights_checksum()

    def drain_trace(self) -> list[dict[str, Any]]:
        return self.tracer.drain()

    def close(self) -> None:
        """Stop the reward processes (a killed Ray actor's reward processes exit on their own)."""
        self.reward.close()

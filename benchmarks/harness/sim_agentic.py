"""``SimAgenticPipeline``: the asynchronous controller's pipeline for multi-turn agentic rollout,
with simulated engines, environments and trainer.

The rollout side is the product code — ``LLMProxy`` over ``SimEngine`` replicas, ``EnvRunner``
(environment-level async or barrier, redundant episodes per group, timeouts), the episode loop
and a local TransferQueue — over ``SimEnv`` instances; the trainer only spends simulated time
(``SimPipeline``'s). Driven by the real ``Controller`` with ``redundant_groups`` it also
runs redundant env groups (``num_env_groups``). Run it on ``sim.clock.run_virtual``.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.sim_env import SimEnvConfig, SimEnvFactory
from sluice.api import SamplingParams
from sluice.api.protocols import WeightUpdateMode
from sluice.queue import AsyncLocalQueue
from sluice.rollout.env_runner import EnvRunner
from sluice.rollout.episode import EpisodeLimits, EpisodeRunner
from sluice.rollout.trajectory import ChatFormat
from sluice.sim.engine import SimEngine
from sluice.sim.pipeline import SimPipeline, SimTrainerConfig
from sluice.sim.task import SimTokenizer, sim_prompts


class SimAgenticPipeline(SimPipeline):
    """``SimPipeline`` whose rollout runs episodes of ``SimEnv`` through an ``EnvRunner``."""

    def __init__(
        self,
        engines: Sequence[SimEngine],
        env: SimEnvConfig,
        *,
        group_size: int,
        group_redundancy: int = 0,
        mode: str = "async",
        turn_tokens: int = 64,
        max_context: int = 1 << 20,
        step_timeout_s: float | None = None,
        weight_update: WeightUpdateMode = "interrupt",
        trainer: SimTrainerConfig | None = None,
        seed: int = 0,
        time_scale: float = 1.0,
    ) -> None:
        prompts = sim_prompts(256, prompt_len=16, seed=seed)
        super().__init__(
            engines,
            prompts,
            group_size=group_size,
            max_new_tokens=turn_tokens,
            weight_update=weight_update,
            trainer=trainer,
            seed=seed,
            time_scale=time_scale,
        )
        tokenizer = SimTokenizer()
        timeout = None if step_timeout_s is None else step_timeout_s * time_scale
        episodes = EpisodeRunner(
            self.proxy,
            SimEnvFactory(env),
            encode_prompt=tokenizer.encode,
            encode=tokenizer.encode,
            decode=tokenizer.decode,
            chat=ChatFormat(turn_end="."),
            params=SamplingParams(turn_tokens),
            limits=EpisodeLimits(env.turns, max_context, turn_tokens, timeout, timeout),
            run_seed=seed,
        )
        self.env_runner = EnvRunner(
            episodes, AsyncLocalQueue(self.queue), group_size=group_size, group_redundancy=group_redundancy, mode=mode
        )
        self.runner = self.env_runner  # type: ignore[assignment]  # the same verbs as GroupRunner

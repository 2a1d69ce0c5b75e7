"""Multi-turn rollout inside the rollout worker: config → ``EnvRunner``, and held-out episodes.

``env_rollout_spec`` resolves the ``agentic`` config section against the task (its own env, if
any) into a picklable ``EnvRolloutSpec``; ``build_env_runner`` builds the ``EpisodeRunner`` and
``EnvRunner`` over the worker's engine (``LLMProxy``), queue and tokenizer;
``evaluate_episodes`` plays one greedy episode per validation row and ``eval.samples`` sampled
ones (success = reward ≥ 1). It schedules nothing itself.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sluice.api import AsyncQueueClient, InferenceEngine, PromptItem, SamplingParams
from sluice.config.agentic import AgenticConfig
from sluice.config.data import EvalConfig
from sluice.rollout.env_runner import EnvRunner
from sluice.rollout.envs import env_factory
from sluice.rollout.episode import EpisodeFailed, EpisodeLimits, EpisodeRunner
from sluice.rollout.evaluate import EvalResult, score_prompts
from sluice.rollout.trajectory import ChatFormat, text_encoder
from sluice.telemetry.trace import SpanRecorder

DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class EnvRolloutSpec:
    """What a rollout worker needs to run episodes (picklable: it travels to a Ray actor)."""

    env: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    mode: str = "async"
    max_turns: int = 8
    turn_tokens: int = 16
    max_context: int | None = None
    group_redundancy: int = 0
    step_timeout_s: float | None = 60.0
    reset_timeout_s: float | None = 60.0
    chat: ChatFormat = field(default_factory=ChatFormat)
    turn_end_from_tokenizer: bool = True


def env_rollout_spec(config: AgenticConfig, task_env: str | None, turn_tokens: int) -> EnvRolloutSpec | None:
    """The spec of a multi-turn run, or ``None`` for a single-turn one (no env configured)."""
    env = config.env or task_env
    if env is None:
        return None
    chat = ChatFormat(config.chat_first, config.chat_observation, config.chat_tools, config.chat_turn_end or "")
    return EnvRolloutSpec(
        env=env,
        env_kwargs=dict(config.env_kwargs),
        mode=config.mode,
        max_turns=config.max_turns,
        turn_tokens=config.turn_tokens or turn_tokens,
        max_context=config.max_context,
        group_redundancy=config.group_redundancy,
        step_timeout_s=config.step_timeout_s,
        reset_timeout_s=config.reset_timeout_s,
        chat=chat,
        turn_end_from_tokenizer=config.chat_turn_end is None,
    )


def build_env_runner(
    spec: EnvRolloutSpec,
    engine: InferenceEngine,
    queue: AsyncQueueClient,
    tokenizer: Any,
    params: SamplingParams,
    *,
    group_size: int,
    run_seed: int,
    model_dir: str | Path,
    tracer: SpanRecorder | None = None,
) -> EnvRunner:
    """An ``EnvRunner`` whose turns stop at the chat format's turn end (the sampling stop token)."""
    chat = replace(spec.chat, turn_end=tokenizer.eos_token) if spec.turn_end_from_tokenizer else spec.chat
    encode = text_encoder(tokenizer)
    stop = tuple(encode(chat.turn_end))
    if len(stop) != 1:
        raise ValueError(f"agentic.chat_turn_end: {chat.turn_end!r} must be exactly one token, got {len(stop)}")
    limits = EpisodeLimits(
        max_turns=spec.max_turns,
        max_context=spec.max_context or _model_context(model_dir),
        turn_tokens=spec.turn_tokens,
        reset_timeout_s=spec.reset_timeout_s,
        step_timeout_s=spec.step_timeout_s,
    )
    episodes = EpisodeRunner(
        engine,
        env_factory(spec.env, spec.env_kwargs),
        encode_prompt=lambda text: list(tokenizer.encode(text)),
        encode=encode,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        chat=chat,
        params=SamplingParams(spec.turn_tokens, params.temperature, params.top_p, stop),
        limits=limits,
        run_seed=run_seed,
    )
    return EnvRunner(
        episodes,
        queue,
        group_size=group_size,
        group_redundancy=spec.group_redundancy,
        mode=spec.mode,
        tracer=tracer,
        name=spec.env,
    )


async def evaluate_episodes(
    episodes: EpisodeRunner, items: list[PromptItem] | tuple[PromptItem, ...], config: EvalConfig | None = None
) -> EvalResult:
    """One greedy episode per row and ``config.samples`` sampled ones at ``config.temperature``;
    success = reward ≥ 1 (a failed episode counts as a miss), scored like single-turn rows."""
    config = config or EvalConfig()
    items = list(items)[: config.max_prompts]

    def runner(temperature: float) -> EpisodeRunner:
        return EpisodeRunner(
            episodes.engine,
            episodes.env_factory,
            episodes.encode_prompt,
            episodes.encode,
            episodes.decode,
            episodes.chat,
            replace(episodes.params, temperature=temperature),
            episodes.limits,
            episodes.run_seed,
        )

    greedy, hot = runner(0.0), runner(config.temperature)

    async def one(player: EpisodeRunner, item: PromptItem, k: int, tag: str) -> float:
        group = item.index if player is greedy else -1 - item.index  # sampled: seeds apart from training's
        try:
            return (await player.run(item, group_id=group, k=k, tag=tag)).reward
        except EpisodeFailed:
            return 0.0

    k = config.samples
    plays = [one(greedy, item, 0, "eval-g") for item in items]
    plays += [one(hot, item, j, "eval-s") for item in items for j in range(k)]
    rewards = await asyncio.gather(*plays)
    n = len(items)
    sampled = [rewards[n + i * k : n + (i + 1) * k] for i in range(n)] if k else None
    return score_prompts(items, rewards[:n], sampled, threshold=1.0)


def _model_context(model_dir: str | Path) -> int:
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return DEFAULT_CONTEXT
    return int(json.loads(config.read_text()).get("max_position_embeddings", DEFAULT_CONTEXT))

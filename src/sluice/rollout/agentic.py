"""Multi-turn rollout inside the rollout worker: config → ``EnvRunner``, and held-out episodes.

``env_rollout_spec`` resolves the ``agentic`` config section against the task (its own env, if
any) into a picklable ``EnvRolloutSpec``; ``build_env_runner`` builds the ``EpisodeRunner`` (or,
with ``agentic.agent``, the ``AgentEpisodeRunner`` behind the OpenAI-compatible endpoint) and the
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

from sluice.api import AsyncQueueClient, InferenceEngine, PromptItem, RewardFn, SamplingParams
from sluice.config import ConfigError
from sluice.config.agentic import AgenticConfig
from sluice.config.data import EvalConfig
from sluice.rollout.agent_runner import AgentEpisodeRunner, load_agent
from sluice.rollout.agent_session import ChatModel, SessionLimits
from sluice.rollout.env_runner import EnvRunner
from sluice.rollout.envs import ENVS, TINY_CHAT_TEMPLATE, env_factory
from sluice.rollout.episode import EpisodeFailed, EpisodeLimits, EpisodeRunner
from sluice.rollout.evaluate import EvalResult, score_prompts
from sluice.rollout.tool_parsers import TOOL_PARSERS
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
    env_latency_s: float = 0.0
    chat: ChatFormat = field(default_factory=ChatFormat)
    turn_end_from_tokenizer: bool = True
    agent: str | None = None
    """``agentic.agent``: episodes are this agent's, through the endpoint (``env`` is then unused)."""
    agent_timeout_s: float | None = 300.0
    agent_process: bool = True
    tool_parser: str = "hermes"
    chat_template: str | None = None
    template_mismatch: str = "refuse"
    hold_for_calls: float = 1.0


def env_rollout_spec(config: AgenticConfig, task_env: str | None, turn_tokens: int) -> EnvRolloutSpec | None:
    """The spec of a multi-turn run, or ``None`` for a single-turn one (no env, no agent configured)."""
    env = config.env or task_env
    if env is None and config.agent is None:
        return None
    template = config.chat_template or (TINY_CHAT_TEMPLATE if task_env in ENVS else None)
    agent = config.agent
    if agent is not None:  # imported here, at the run's start: a bad path is one clear error
        file, _, attr = agent.rpartition(":")
        agent = f"{Path(file).resolve()}:{attr}" if file.endswith(".py") else agent  # workers' cwd may differ
        try:
            load_agent(agent)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    chat = ChatFormat(config.chat_first, config.chat_observation, config.chat_tools, config.chat_turn_end or "")
    return EnvRolloutSpec(
        env=env or "",
        env_kwargs=dict(config.env_kwargs),
        mode=config.mode,
        max_turns=config.max_turns,
        turn_tokens=config.turn_tokens or turn_tokens,
        max_context=config.max_context,
        group_redundancy=config.group_redundancy,
        step_timeout_s=config.step_timeout_s,
        reset_timeout_s=config.reset_timeout_s,
        env_latency_s=config.env_latency_s,
        chat=chat,
        turn_end_from_tokenizer=config.chat_turn_end is None,
        agent=agent,
        agent_timeout_s=config.agent_timeout_s,
        agent_process=config.agent_process,
        tool_parser=config.tool_parser,
        chat_template=template,
        template_mismatch=config.template_mismatch,
        hold_for_calls=config.hold_for_calls,
    )


def action_text(tokenizer: Any, ids: list[int], stop: tuple[int, ...]) -> str:
    """A model turn's text as the env sees it: the closing turn-end token left out, every other
    token spelled, special ones too (a sampled ``<unk>`` stays in the tool call): what the agent
    endpoint hands an agent for the same tokens (``AgentSession.decode``), so an env and an agent
    that play the same turns get the same tool results."""
    return str(tokenizer.decode(ids[:-1] if ids and ids[-1] in stop else ids, skip_special_tokens=False))


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
    reward: RewardFn | None = None,
) -> EnvRunner:
    """An ``EnvRunner`` whose turns stop at the chat format's turn end (the sampling stop token);
    ``reward`` scores an agent's episode when the agent returns ``None``."""
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
        step_latency_s=spec.env_latency_s,
    )
    turn_params = SamplingParams(spec.turn_tokens, params.temperature, params.top_p, stop)
    episodes: EpisodeRunner | AgentEpisodeRunner
    if spec.agent is not None:
        episodes = _agent_runner(spec, engine, tokenizer, turn_params, limits, reward, run_seed)
    else:
        episodes = EpisodeRunner(
            engine,
            env_factory(spec.env, spec.env_kwargs),
            encode_prompt=text_encoder(tokenizer, special_tokens=True),
            encode=encode,
            decode=lambda ids: action_text(tokenizer, ids, stop),
            chat=chat,
            params=turn_params,
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
        name=spec.agent or spec.env,
        role="agent" if spec.agent else "environment",
    )


def _agent_runner(
    spec: EnvRolloutSpec,
    engine: InferenceEngine,
    tokenizer: Any,
    params: SamplingParams,
    limits: EpisodeLimits,
    reward: RewardFn | None,
    run_seed: int,
) -> AgentEpisodeRunner:
    assert spec.agent is not None
    template = spec.chat_template or getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise ConfigError(
            f"agentic.agent: the model's tokenizer has no chat template to render {spec.agent!r}'s calls; "
            "set agentic.chat_template"
        )
    model = ChatModel(tokenizer, template, TOOL_PARSERS[spec.tool_parser])
    session = SessionLimits(limits.max_turns, limits.max_context, limits.turn_tokens, params,
                            spec.template_mismatch)  # type: ignore[arg-type]  # fmt: skip
    try:
        return AgentEpisodeRunner(engine, spec.agent, model, session, reward=reward, timeout_s=spec.agent_timeout_s,
                                  run_seed=run_seed, process=spec.agent_process)  # fmt: skip
    except ValueError as err:  # an agent path that does not import, or no openai package
        raise ConfigError(str(err)) from err


async def evaluate_episodes(
    episodes: EpisodeRunner | AgentEpisodeRunner,
    items: list[PromptItem] | tuple[PromptItem, ...],
    config: EvalConfig | None = None,
) -> EvalResult:
    """One greedy episode per row and ``config.samples`` sampled ones at ``config.temperature``;
    success = reward ≥ 1 (a failed episode counts as a miss), scored like single-turn rows."""
    config = config or EvalConfig()
    items = list(items)[: config.max_prompts]

    greedy, hot = episodes.with_temperature(0.0), episodes.with_temperature(config.temperature)

    async def one(player: EpisodeRunner | AgentEpisodeRunner, item: PromptItem, k: int, tag: str) -> float:
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

"""Reward functions and the reward service that runs them.

Built-ins are entries of ``REWARDS`` (a plain dict of name → factory taking the run's
``RewardConfig``): ``exact_match``, ``math_verify`` (optional extra ``sluice[math]``) and
``code_exec`` (sandboxed Python against the row's ``tests``). ``resolve_reward`` turns the
``reward`` section into one function: a built-in, your own by import path (``reward.fn``,
``imported.py``), a router by data source (``reward.by_source``), under an optional format gate
(``composed.py``); ``build_reward_service`` wraps it in a ``RewardService`` (process pool,
per-call timeout, failure counters). The overlong penalty needs token counts, so the rollout
applies it (``overlong_shaping``). A scalar reward model (``reward.model``) scores whole groups:
``build_model_reward`` starts its workers (``reward_model.py``) and combines its score
(``combine.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sluice.api import RewardFailure
from sluice.config import ConfigError
from sluice.rewards.code_exec import CodeExecReward
from sluice.rewards.combine import ModelReward
from sluice.rewards.composed import FormattedReward, OverlongPenalty, SourceRouter, overlong_penalty
from sluice.rewards.exact_match import exact_match_reward
from sluice.rewards.imported import ImportedReward, load_reward
from sluice.rewards.judge import JudgeScorer, JudgeSpec
from sluice.rewards.math_answer import math_verify_reward
from sluice.rewards.reward_model import RewardModelPool, RewardModelSpec
from sluice.rewards.sandbox import SandboxLimits, SandboxUnavailable, require_sandbox
from sluice.rewards.service import RewardService, reward_name

if TYPE_CHECKING:
    from sluice.config.services import RewardConfig


def sandbox_limits(cfg: RewardConfig) -> SandboxLimits:
    """The ``reward.sandbox_*`` options as the sandbox's limits."""
    return SandboxLimits(
        cpu_s=cfg.sandbox_cpu_s,
        memory_mb=cfg.sandbox_memory_mb,
        wall_s=cfg.sandbox_wall_s,
        output_kb=cfg.sandbox_output_kb,
        network=cfg.sandbox_network,
        processes=cfg.sandbox_processes,
        isolation=cfg.sandbox_isolation,
    )


def code_exec_reward(cfg: RewardConfig) -> CodeExecReward:
    """``code_exec`` as configured; raises ``SandboxUnavailable`` where its sandbox cannot run here."""
    limits = sandbox_limits(cfg)
    require_sandbox(limits)
    return CodeExecReward(limits, scoring=cfg.code_exec_scoring)


REWARDS: dict[str, Callable[[RewardConfig], Callable[..., Any]]] = {
    "exact_match": lambda cfg: exact_match_reward,
    "math_verify": lambda cfg: math_verify_reward,
    "code_exec": code_exec_reward,
}


def _reward_by_ref(ref: str, field: str, cfg: RewardConfig) -> Callable[..., Any]:
    """A built-in by name, or a function by import path (imported now: a bad path raises here)."""
    if ref in REWARDS:
        return REWARDS[ref](cfg)
    load_reward(ref, field)
    return ImportedReward(ref, field)


def resolve_reward(cfg: RewardConfig, default: Callable[..., Any] | None) -> Callable[..., Any]:
    """The function a run scores with: ``reward.fn`` or ``reward.name`` (else ``default``, the
    task's or the user's reward), routed by ``reward.by_source`` (whose fallback is ``fn`` /
    ``name`` only) and gated by ``reward.format_pattern``. Import paths are imported here: a
    missing module or function is a ``ConfigError`` naming its field."""
    if cfg.name is not None and cfg.name not in REWARDS:
        raise ValueError(f"reward.name: unknown reward {cfg.name!r} (built-in: {', '.join(REWARDS)})")
    configured = None
    if cfg.fn is not None:
        configured = _reward_by_ref(cfg.fn, "reward.fn", cfg)
    elif cfg.name is not None:
        configured = REWARDS[cfg.name](cfg)
    fn: Callable[..., Any] | None = default if configured is None else configured
    if cfg.by_source:
        routes = {src: _reward_by_ref(ref, f"reward.by_source.{src}", cfg) for src, ref in cfg.by_source.items()}
        fn = SourceRouter(routes, configured)
    if fn is None:
        raise ValueError("no reward: set reward.name, reward.fn or reward.by_source, or pass RLTrainer(reward=...)")
    if cfg.format_pattern is not None:
        fn = FormattedReward(fn, cfg.format_pattern, cfg.format_score)
    return fn


def overlong_shaping(cfg: RewardConfig, max_new_tokens: int) -> OverlongPenalty | None:
    """``reward.overlong_buffer`` with the run's response limit as ``L_max`` (``None``: off);
    a buffer not below the limit is a ``ConfigError``."""
    if cfg.overlong_buffer == 0:
        return None
    return OverlongPenalty(max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)


def check_reward(cfg: RewardConfig, user_reward: Callable[..., Any] | None, max_new_tokens: int) -> None:
    """What a run checks at start, before any worker: one choice of reward (``RLTrainer(reward=...)``
    or the ``reward`` section), every import path importable, an overlong buffer below the
    response limit. Raises ``ConfigError`` naming the field; builds nothing (a ``code_exec``
    sandbox is checked where the reward is built)."""
    chosen = [f"reward.{key}" for key in ("name", "fn", "by_source") if getattr(cfg, key)]
    if user_reward is not None and chosen:
        raise ConfigError(f"{' and '.join(chosen)}: set, and RLTrainer(reward=...) given too: choose one reward")
    if cfg.fn is not None:
        load_reward(cfg.fn, "reward.fn")
    for source, ref in cfg.by_source.items():
        if ref not in REWARDS:
            load_reward(ref, f"reward.by_source.{source}")
    overlong_shaping(cfg, max_new_tokens)


def build_reward_service(cfg: RewardConfig, default: Callable[..., Any] | None) -> RewardService:
    """The service for the ``reward`` section (``resolve_reward``; ``default``: the task's or the
    user's reward, used when no ``reward.name`` / ``reward.fn`` / ``reward.by_source`` is set)."""
    fn = resolve_reward(cfg, default)
    return RewardService(
        fn,
        pool_size=cfg.pool_size,
        timeout_s=cfg.timeout_s,
        start_method=cfg.start_method,
        name="by_source" if cfg.by_source else cfg.name or reward_name(fn),
        latency_s=cfg.latency_s,
    )


__all__ = [
    "REWARDS",
    "CodeExecReward",
    "FormattedReward",
    "ImportedReward",
    "OverlongPenalty",
    "RewardFailure",
    "RewardService",
    "SandboxLimits",
    "SandboxUnavailable",
    "SourceRouter",
    "build_reward_service",
    "check_reward",
    "code_exec_reward",
    "exact_match_reward",
    "load_reward",
    "math_verify_reward",
    "overlong_penalty",
    "overlong_shaping",
    "resolve_reward",
    "sandbox_limits",
]


async def no_rule_reward(response: str, **fields: Any) -> float:
    """The training reward of ``reward.combine: model``: the reward model's score alone, so the
    rule reward is not called (it scores evaluation only)."""
    return 0.0


def build_model_reward(
    cfg: RewardConfig, spec: RewardModelSpec | None, judge: JudgeSpec | None = None
) -> ModelReward | None:
    """The run's reward model (``reward.model``, its workers started) or LLM judge
    (``reward.judge``) and how its score combines; ``None`` without either."""
    if spec is None and judge is None:
        return None
    scorer = RewardModelPool(spec) if spec is not None else JudgeScorer(judge) if judge is not None else None
    return ModelReward(scorer, cfg.combine, cfg.model_weight, cfg.rule_weight, cfg.model_normalize)

"""Reward functions and the reward service that runs them.

Built-ins are entries of ``REWARDS`` (a plain dict of name → factory taking the run's
``RewardConfig``): ``exact_match``, ``math_verify`` (optional extra ``sluice[math]``) and
``code_exec`` (sandboxed Python against the row's ``tests``). ``build_reward_service`` wraps the
chosen function in a ``RewardService`` (process pool, per-call timeout, failure counters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sluice.api import RewardFailure
from sluice.rewards.code_exec import CodeExecReward
from sluice.rewards.exact_match import exact_match_reward
from sluice.rewards.math_answer import math_verify_reward
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


def build_reward_service(cfg: RewardConfig, default: Callable[..., Any]) -> RewardService:
    """The service for ``cfg.name`` (``None``: ``default``, the task's or the user's reward)."""
    if cfg.name is not None and cfg.name not in REWARDS:
        raise ValueError(f"reward.name: unknown reward {cfg.name!r} (built-in: {', '.join(REWARDS)})")
    fn = default if cfg.name is None else REWARDS[cfg.name](cfg)
    return RewardService(
        fn,
        pool_size=cfg.pool_size,
        timeout_s=cfg.timeout_s,
        start_method=cfg.start_method,
        name=cfg.name or reward_name(fn),
    )


__all__ = [
    "REWARDS",
    "CodeExecReward",
    "RewardFailure",
    "RewardService",
    "SandboxLimits",
    "SandboxUnavailable",
    "build_reward_service",
    "code_exec_reward",
    "exact_match_reward",
    "math_verify_reward",
    "sandbox_limits",
]

"""``SimEnv``: an ``Env`` whose steps cost simulated time, with fail-slow and fail-stop injection.

It reproduces what makes agentic rollout scheduling matter (DESIGN.md "Simulation is a product
feature"): step latencies from a Gaussian clipped at 0 (``std`` 0: a fixed latency), a rare
fail-slow step that takes ``fail_slow_s`` longer, a fail-stop step that never returns (the
environment hung) and a crash that raises. Episodes last ``turns`` steps; the final reward is 1
with probability ``success_rate``. Every instance draws from its own stream, seeded by
(config seed, instance number, episode seed), so a run on ``sim.clock.run_virtual`` is exactly
reproducible. Observations are short fixed strings; the env never looks at the action's text
beyond counting turns. It measures nothing; ``benchmarks/agentic.py`` does.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.api import EnvStep


class SimEnvCrash(RuntimeError):
    """Raised by a ``SimEnv`` step chosen to crash (``crash_prob``)."""


@dataclass(frozen=True)
class SimEnvConfig:
    """Cost and failure model of a simulated environment (times in simulated seconds)."""

    turns: int = 4
    """Steps until the episode is done."""
    latency_mean_s: float = 10.0
    """Mean step latency (Gaussian, clipped at 0)."""
    latency_std_s: float = 0.0
    """Standard deviation of the step latency (0: every step takes the mean)."""
    reset_s: float = 0.0
    """Latency of ``reset``."""
    fail_slow_prob: float = 0.0
    """Per step: probability the step takes ``fail_slow_s`` longer."""
    fail_slow_s: float = 0.0
    """Extra latency of a fail-slow step."""
    fail_stop_prob: float = 0.0
    """Per step: probability the step never returns (a hung environment)."""
    crash_prob: float = 0.0
    """Per step: probability the step raises ``SimEnvCrash``."""
    success_rate: float = 0.5
    """Probability the final step's reward is 1 (else 0)."""
    time_scale: float = 1.0
    """Event-loop seconds per simulated second."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("fail_slow_prob", "fail_stop_prob", "crash_prob", "success_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SimEnvConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.turns < 1:
            raise ValueError(f"SimEnvConfig.turns must be >= 1, got {self.turns}")


class SimEnv:
    """One simulated environment instance (see the module docstring)."""

    def __init__(self, config: SimEnvConfig, instance: int = 0) -> None:
        self.config = config
        self.instance = instance
        self._rng = random.Random()
        self._step = 0
        self.closed = False

    async def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> str:
        self._rng.seed(hash((self.config.seed, self.instance, seed)))
        self._step = 0
        await self._sleep(self.config.reset_s)
        return "start"

    async def step(self, action: str) -> EnvStep:
        cfg, rng = self.config, self._rng
        latency = (
            max(0.0, rng.gauss(cfg.latency_mean_s, cfg.latency_std_s)) if cfg.latency_std_s else cfg.latency_mean_s
        )
        slow, stop, crash, win = rng.random(), rng.random(), rng.random(), rng.random()
        if slow < cfg.fail_slow_prob:
            latency += cfg.fail_slow_s
        if stop < cfg.fail_stop_prob:
            await asyncio.Event().wait()  # hangs until cancelled (a timeout or an abort)
        await self._sleep(latency)
        if crash < cfg.crash_prob:
            raise SimEnvCrash(f"simulated crash at step {self._step}")
        self._step += 1
        done = self._step >= cfg.turns
        reward = float(win < cfg.success_rate) if done else 0.0
        return EnvStep(f"o{self._step}", reward, done)

    async def close(self) -> None:
        self.closed = True

    async def _sleep(self, sim_seconds: float) -> None:
        if sim_seconds > 0:
            await asyncio.sleep(sim_seconds * self.config.time_scale)


class SimEnvFactory:
    """Makes numbered ``SimEnv`` instances (each with its own random stream)."""

    def __init__(self, config: SimEnvConfig) -> None:
        self.config = config
        self._numbers = itertools.count()

    def __call__(self) -> SimEnv:
        return SimEnv(self.config, next(self._numbers))

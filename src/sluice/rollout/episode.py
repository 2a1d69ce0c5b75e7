"""One episode of one environment instance: reset → generate → step → … → done, as tokens.

``EpisodeRunner.run`` is ROLL Flash's EnvManager loop for a single trajectory: it resets the env,
asks the engine (``LLMProxy``) for the model's turn, steps the env with the decoded action, and
repeats until the env says done, the turn limit or the context is reached; the reward is the sum
of the step rewards, known the moment the episode ends. Every env call has a timeout; an env
that raises or hangs fails its episode (``EpisodeFailed``, with the reason the runner counts),
never the run. With a ``TurnBarrier`` the episodes of a wave move in lockstep (the baseline that
environment-level async rollout is measured against; the caller makes a finished episode leave
it). Groups, redundancy and the queue are ``env_runner.py``'s.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from sluice.api import Completion, Env, GenerationRequest, InferenceEngine, PromptItem, Sample, SamplingParams, ToolEnv
from sluice.rollout.single_turn import sample_seed
from sluice.rollout.trajectory import ChatFormat, Encode, Trajectory

T = TypeVar("T")


class EpisodeFailed(Exception):
    """An episode that cannot produce a sample; ``reason`` is what the runner counts."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class TurnBarrier:
    """Lockstep for a wave of episodes: every party waits until all still running arrive; a party
    whose episode ended ``leave`` s (so the others never wait for it)."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.arrived = 0
        self.waits = 0
        """Times a party had to wait for others (the cost the async mode removes)."""
        self._release: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        self.arrived += 1
        if self.arrived >= self.parties:
            self._open()
            return
        self.waits += 1
        if self._release is None:
            self._release = asyncio.get_running_loop().create_future()
        release = self._release
        try:
            await asyncio.shield(release)
        except asyncio.CancelledError:
            if release is self._release:  # not released yet: it no longer counts as arrived
                self.arrived -= 1
            raise

    def leave(self) -> None:
        self.parties -= 1
        if self.parties > 0 and self.arrived >= self.parties:
            self._open()

    def _open(self) -> None:
        self.arrived = 0
        release, self._release = self._release, None
        if release is not None and not release.done():
            release.set_result(None)


@dataclass(frozen=True)
class EpisodeLimits:
    """Bounds of one episode (times in event-loop seconds; ``None``: no timeout)."""

    max_turns: int
    max_context: int
    turn_tokens: int
    reset_timeout_s: float | None = None
    step_timeout_s: float | None = None
    step_latency_s: float = 0.0  # μ of each step's wait (``agentic.env_latency_s``)


class EpisodeRunner:
    """Runs episodes of envs from ``env_factory`` against ``engine`` (see the module docstring)."""

    def __init__(
        self,
        engine: InferenceEngine,
        env_factory: Callable[[], Env],
        encode_prompt: Encode,
        encode: Encode,
        decode: Callable[[list[int]], str],
        chat: ChatFormat,
        params: SamplingParams,
        limits: EpisodeLimits,
        run_seed: int = 0,
    ) -> None:
        self.engine = engine
        self.env_factory = env_factory
        self.encode_prompt = encode_prompt
        self.encode = encode
        self.decode = decode
        self.chat = chat
        self.params = params
        self.limits = limits
        self.run_seed = run_seed
        self.turn_end_ids = tuple(encode(chat.turn_end))
        self.close_errors = 0

    async def run(
        self, item: PromptItem, group_id: int, k: int, barrier: TurnBarrier | None = None, tag: str = "g"
    ) -> Sample:
        """Episode ``k`` of group ``group_id`` on the prompt row ``item`` (its fields are the env's
        reset options, its index the env seed)."""
        env = self.env_factory()
        try:
            obs = await self._env_call(env.reset(int(item.fields.get("seed", item.index)), item.fields), "reset")
            tools = env.tools() if isinstance(env, ToolEnv) else ()
            traj = Trajectory(tuple(self.encode_prompt(self.chat.first_prompt(obs, tools))), 0)
            reward, finish = 0.0, "max_turns"
            for turn in range(self.limits.max_turns):
                budget = min(self.limits.turn_tokens, self.limits.max_context - len(traj.context))
                if budget < 1:
                    finish = "context"
                    break
                if barrier is not None:
                    await barrier.wait()
                completion = await self._generate(traj, budget, f"{tag}{group_id}-e{k}", group_id, k, turn)
                action = self.decode(list(completion.token_ids))
                traj.add_model_turn(completion, self.turn_end_ids, action)
                if barrier is not None:
                    await barrier.wait()
                seed = sample_seed(self.run_seed, group_id, k * 1009 + turn) + 1  # not the sampling stream
                wait = waiting_latency(self.limits.step_latency_s, seed)
                step = await self._env_call(_after(wait, env.step(action)), "step")
                reward += float(step.reward)
                if step.done:
                    finish = "done"
                    break
                if turn + 1 < self.limits.max_turns:
                    traj.add_env_tokens(self.encode(self.chat.env_turn(step.observation)))
            meta = {"prompt_index": item.index, "finish_reason": finish, "episode": k}
            return traj.to_sample(f"{group_id}-{k}", group_id, reward, meta)
        finally:
            await self._close(env)

    def with_temperature(self, temperature: float) -> EpisodeRunner:
        """The same runner sampling at ``temperature`` (evaluation's greedy and sampled episodes)."""
        return EpisodeRunner(
            self.engine, self.env_factory, self.encode_prompt, self.encode, self.decode, self.chat,
            replace(self.params, temperature=temperature), self.limits, self.run_seed,
        )  # fmt: skip

    def stats(self) -> dict[str, float]:
        return {"close_errors": float(self.close_errors)}

    def close(self) -> None:
        """Nothing to release (environments close with their episodes)."""

    async def _generate(
        self, traj: Trajectory, budget: int, episode: str, group_id: int, k: int, turn: int
    ) -> Completion:
        """Turn ``turn`` of ``episode``: a request of the episode's session (its engine may reuse the
        cache of the previous turn, whose tokens its context extends)."""
        params = SamplingParams(budget, self.params.temperature, self.params.top_p, self.params.stop_token_ids)
        seed = sample_seed(self.run_seed, group_id, k * 1009 + turn)
        request_id = f"{episode}-t{turn}"
        request = GenerationRequest(
            request_id, traj.context, params, seed=seed, affinity=f"g{group_id}-e{k}", session=episode
        )
        try:
            completion = await self.engine.generate(request)
        except asyncio.CancelledError:
            self.engine.abort(request_id)
            raise
        if completion.finish_reason == "abort":
            raise EpisodeFailed("engine_abort", request_id)
        return completion

    async def _env_call(self, call: Awaitable[T], verb: str) -> T:
        timeout = self.limits.reset_timeout_s if verb == "reset" else self.limits.step_timeout_s
        try:
            return await asyncio.wait_for(call, timeout)
        except TimeoutError as err:
            raise EpisodeFailed("env_timeout", f"{verb} took longer than {timeout}s") from err
        except asyncio.CancelledError:
            raise
        except Exception as err:  # an env's own bug or crash fails its episode, not the run
            raise EpisodeFailed("env_error", f"{verb}: {err!r}") from err

    async def _close(self, env: Env) -> None:
        try:
            await asyncio.wait_for(env.close(), self.limits.step_timeout_s)
        except Exception:  # the episode's outcome stands either way; counted
            self.close_errors += 1


def waiting_latency(mean_s: float, seed: int) -> float:
    """One call's wait: Gaussian with mean and standard deviation ``mean_s``, clipped at 0."""
    return max(0.0, random.Random(seed).gauss(mean_s, mean_s)) if mean_s > 0 else 0.0


async def _after(wait_s: float, call: Awaitable[T]) -> T:
    if wait_s > 0:
        await asyncio.sleep(wait_s)
    return await call

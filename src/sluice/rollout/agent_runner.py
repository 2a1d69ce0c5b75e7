"""Agents by import path: a user's OpenAI-client code plays episodes through the endpoint.

``agentic.agent: package.module:run`` (or ``path/to/agent.py:run``) names a function ``run(client, row)``: ``client`` an
``openai`` client whose ``base_url`` is its episode's endpoint (``agent_endpoint.py``; its calls
reach it without a socket, ``agent_transport.py``, plain ``chat.completions`` calls without the
client's HTTP machinery, ``agent_client.py``, unless ``transport="http"``), ``row`` the
dataset row (``prompt``, ``index`` and the row's fields). It returns the episode's reward, or
``None`` to leave it to the run's reward function, which then scores the last model turn's text.

``AgentEpisodeRunner`` has ``EpisodeRunner``'s ``run``, so ``EnvRunner`` drives agents exactly as
environments: groups, redundancy, straggler aborts, failure counting and the controller's env
groups apply unchanged. Agents run as tasks on an event loop of their own (never the engine's
loop, which must keep sampling): with ``process=True`` (``agentic.agent_process``, the run's
default) in a child process whose calls come over a pipe (``agent_process.py``), else in a thread
of this process; a synchronous ``run`` gets an ``openai.OpenAI`` client and runs in that loop's
thread pool. Each episode has a timeout (``agentic.agent_timeout_s``).
Fates: an agent that raises fails its episode (``agent_error``), one past its timeout
``agent_timeout`` (its task is cancelled and its requests aborted), a refused history
``template_mismatch``, a reward function that fails on it ``reward_error``; an agent that raises
after the endpoint refused a call at ``max_turns`` or the context keeps its episode (ended at
that limit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import threading
from collections import Counter
from dataclasses import replace
from typing import Any, Literal

from sluice.api import InferenceEngine, PromptItem, RewardFailure, RewardFn, Sample
from sluice.rollout.agent_client import direct_chat
from sluice.rollout.agent_endpoint import AgentEndpoint
from sluice.rollout.agent_loader import load_agent
from sluice.rollout.agent_process import AgentProcess
from sluice.rollout.agent_session import AgentSession, ChatModel, ExpectedCalls, SessionLimits
from sluice.rollout.agent_transport import transports
from sluice.rollout.episode import EpisodeFailed, TurnBarrier

COUNTERS = ("calls", "mismatches", "segments", "tool_calls", "malformed_tool_calls", "sampling_overridden")


class AgentLoop:
    """An event loop in a daemon thread, with a thread pool for synchronous agents."""

    def __init__(self, threads: int = 64) -> None:
        self.loop = asyncio.new_event_loop()
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="agent")
        self.loop.set_default_executor(self.pool)
        self._thread = threading.Thread(target=self.loop.run_forever, name="agent-loop", daemon=True)
        self._thread.start()

    def submit(self, coroutine: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.pool.shutdown(wait=False, cancel_futures=True)


class AgentEpisodeRunner:
    """Plays episodes of an agent over ``engine`` (see the module docstring)."""

    def __init__(
        self,
        engine: InferenceEngine,
        agent: str,
        model: ChatModel,
        limits: SessionLimits,
        *,
        reward: RewardFn | None,
        timeout_s: float | None,
        run_seed: int = 0,
        transport: Literal["in_process", "http"] = "in_process",
        process: bool = False,
    ) -> None:
        try:
            import openai
        except ImportError as err:
            raise ValueError("agentic.agent: needs the openai package (pip install 'sluice[agent]')") from err
        self.openai = openai
        self.engine, self.agent_path, self.model, self.limits = engine, agent, model, limits
        self.agent = load_agent(agent)
        self.is_async = inspect.iscoroutinefunction(self.agent)
        self.reward, self.timeout_s, self.run_seed = reward, timeout_s, run_seed
        self.endpoint = AgentEndpoint()
        self.agents = AgentLoop()
        self.transport = transport
        self.process = AgentProcess(agent, self.endpoint) if process else None
        self._async_http: Any = None
        self._sync_http = self._http_client(sync=True) if not self.is_async else None
        self.counts: Counter[str] = Counter()
        self.expected = ExpectedCalls()
        """Episodes whose next call is on its way (an engine may wait for them: ``agentic.hold_for_calls``)."""

    async def run(
        self, item: PromptItem, group_id: int, k: int, barrier: TurnBarrier | None = None, tag: str = "g"
    ) -> Sample:
        """Episode ``k`` of group ``group_id``: the agent on the row ``item``, its calls recorded."""
        if barrier is not None:
            raise ValueError("agentic.mode: barrier moves Env episodes in lockstep; an agent's turns are its own")
        session = AgentSession(self.engine, self.model, self.limits, run_seed=self.run_seed, group_id=group_id, k=k,
                               tag=tag, expected=self.expected)  # fmt: skip
        key = self.endpoint.open(session)
        row = {"prompt": item.prompt, "index": item.index, **item.fields}
        if self.process is not None:
            future = self.process.submit(self.endpoint.base_url(key), key, row)
        else:
            future = self.agents.submit(self._play(self.endpoint.base_url(key), key, row))
        try:
            result = await self._outcome(session, future)
            reward = float(result) if result is not None else await self._score(session, item)
            meta = {"prompt_index": item.index, "episode": k, "calls": session.counts["calls"]}
            return session.sample(reward, meta)
        finally:
            self.endpoint.close_session(key)
            future.cancel()
            session.abort()
            self.counts.update(session.counts)

    async def _outcome(self, session: AgentSession, future: concurrent.futures.Future[Any]) -> Any:
        """The agent's return value, or the ``EpisodeFailed`` its episode ends with."""
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError as err:
            raise EpisodeFailed("agent_timeout", f"no result within {self.timeout_s}s") from err
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the agent's own failure fails its episode, never the run
            if session.failure is not None:
                raise EpisodeFailed(session.failure, repr(err)) from err
            if session.finish in ("max_turns", "context") and session.counts["calls"]:
                return None  # the endpoint ended the episode at a limit; the agent's reaction is moot
            raise EpisodeFailed("agent_error", repr(err)) from err
        if session.failure is not None:  # the agent swallowed the refusal: its record is still unusable
            raise EpisodeFailed(session.failure, "the agent went on after its call was refused")
        if not session.counts["calls"]:
            raise EpisodeFailed("agent_error", "the agent made no model call")
        if result is not None and (isinstance(result, bool) or not isinstance(result, int | float)):
            raise EpisodeFailed("agent_error", f"returned {result!r:.80}; expected a number or None")
        return result

    async def _score(self, session: AgentSession, item: PromptItem) -> float:
        if self.reward is None:
            raise EpisodeFailed("agent_error", "the agent returned None and the run has no reward function")
        try:
            value = self.reward(session.last_text, **item.fields)  # the worker's RewardService is async
            return float(await value if inspect.isawaitable(value) else value)
        except RewardFailure as failure:  # counted by the reward service; the episode cannot be kept
            raise EpisodeFailed("reward_error", str(failure)) from failure

    async def _play(self, base_url: str, key: str, row: dict[str, Any]) -> Any:
        """On the agents' loop: a client for the episode (over one shared connection pool: a
        client of its own costs ~50 ms of CPU), then the agent."""
        if self.is_async:
            if self._async_http is None:  # made on the agents' loop, which it is bound to
                self._async_http = self._http_client(sync=False)
            client = self.openai.AsyncOpenAI(
                base_url=base_url, api_key=key, max_retries=0, http_client=self._async_http
            )
            if self.transport == "in_process":
                client = direct_chat(self.openai, client, self.endpoint.answer_async)
            return await self.agent(client, row)

        def play() -> Any:
            client = self.openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=self._sync_http)
            if self.transport == "in_process":
                client = direct_chat(self.openai, client, answer=self.endpoint.answer)
            return self.agent(client, row)

        return await asyncio.get_running_loop().run_in_executor(None, play)

    def _http_client(self, *, sync: bool) -> Any:
        """The HTTP client under every episode's ``openai`` client: over ``transport: in_process``
        (the default) calls reach the endpoint without a socket (``agent_transport.py``); over
        ``http``, through the loopback server."""
        make = self.openai.DefaultHttpxClient if sync else self.openai.DefaultAsyncHttpxClient
        if self.transport == "http":
            return make()
        in_process, in_process_sync = transports(self.endpoint, self.openai)
        return make(transport=in_process_sync if sync else in_process)

    def with_temperature(self, temperature: float) -> AgentEpisodeRunner:
        """The same agent, endpoint and counters at another temperature (evaluation's greedy runs)."""
        other = copy.copy(self)
        other.limits = replace(self.limits, params=replace(self.limits.params, temperature=temperature))
        return other

    def stats(self) -> dict[str, float]:
        """``agent_*`` counters (``env_agent_*`` in the run's ``episodes`` record): calls,
        mismatches, segments, tool calls (malformed ones), sampling overrides, endpoint errors."""
        counts = dict.fromkeys(COUNTERS, 0) | dict(self.counts)
        return {f"agent_{k}": float(v) for k, v in counts.items()} | {
            "agent_endpoint_errors": float(self.endpoint.errors)
        }

    def close(self) -> None:
        if self._async_http is not None:
            self.agents.submit(self._async_http.aclose()).result(timeout=5)
        if self._sync_http is not None:
            self._sync_http.close()
        if self.process is not None:
            self.process.close()
        self.endpoint.close()
        self.agents.close()

"""One agent episode's token record behind the OpenAI-compatible endpoint: chat calls in, tokens out.

An ``AgentSession`` serves the ``chat.completions`` calls of one episode (one key). Each call's
messages are rendered with the model's chat template and tokenised; that prompt must *extend*
what the session already recorded (the first prompt, then every sampled turn and the template's
tokens between turns). The extension (the template's closers, tool results, the next turn's
opening) is appended with loss mask 0; the engine's sampled tokens are appended exactly as
sampled (loss mask 1, their log-probs and per-token versions, ``trajectory.py``). The chat text is
never re-tokenised into the record.

**Mismatch policy** (``agentic.template_mismatch``): when a rendered prompt does not start with
the recorded tokens (a template that re-renders history differently, e.g. drops earlier
reasoning, or an agent that edited its history), the session counts it (``mismatches``) and
``refuse`` answers the call with an error, failing the episode (``template_mismatch``); or
``restart`` starts a new segment: the record restarts from the new prompt (mask 0) and the
earlier segment is dropped from training (``segments`` counts them).

Sampling: the run's temperature / top-p decide (the trainer's log-probs assume them); a call's own
``temperature`` / ``top_p`` are accepted and, when they differ, counted (``sampling_overridden``).
``max_tokens`` and ``stop`` (each stop string one token) are honoured within ``turn_tokens`` and
the context. A turn's text is its sampled tokens decoded with special tokens kept, less the turn's
closing stop token (the template writes that one back); a ``stop`` word the model sampled stays in
the text, so the next render reproduces it. The HTTP side is ``agent_endpoint.py``; running
agents, ``agent_runner.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sluice.api import Completion, GenerationRequest, InferenceEngine, Sample, SamplingParams
from sluice.rollout.single_turn import sample_seed
from sluice.rollout.tool_parsers import ToolParser, template_messages
from sluice.rollout.trajectory import Trajectory

MismatchPolicy = Literal["refuse", "restart"]


class ChatRequest(BaseModel):
    """The ``POST /v1/chat/completions`` body sluice reads (other OpenAI fields are ignored)."""

    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1


class EndpointError(Exception):
    """A call the endpoint answers with an HTTP error (``status``) and a one-line message."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ExpectedCalls:
    """How many episodes had a call answered and have neither made their next call nor ended: calls
    known to be on their way, which an engine may wait for before a step
    (``api.ExpectsRequests``, ``engines/arrival_hold.py``). Sessions keep it; read on the
    engine's loop, where every call runs."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> float:
        return float(self.count)


@dataclass(frozen=True)
class ChatModel:
    """The model's text side: its tokenizer (``encode`` without special tokens, ``decode``) and
    the chat template calls are rendered with."""

    tokenizer: Any
    template: str
    parser: ToolParser

    def render(self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            template_messages(messages), tools=tools or None, chat_template=self.template,
            add_generation_prompt=True, tokenize=False,
        )  # fmt: skip
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of sampled tokens, special tokens included (rendered back, they become the same
        ids; the turn's closing stop token is the template's and is left out by the caller)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def stop_ids(self, stop: str | list[str] | None) -> tuple[int, ...]:
        words = [stop] if isinstance(stop, str) else list(stop or [])
        ids = []
        for word in words:
            encoded = self.tokenizer.encode(word, add_special_tokens=False)
            if len(encoded) != 1:
                raise EndpointError(400, f"stop: {word!r} is {len(encoded)} tokens; each stop string must be one token")
            ids.append(int(encoded[0]))
        return tuple(ids)


@dataclass(frozen=True)
class SessionLimits:
    """An episode's bounds and sampling (the run's), as ``EpisodeLimits`` for env episodes."""

    max_turns: int
    max_context: int
    turn_tokens: int
    params: SamplingParams
    """The run's temperature and top-p, and the turn-end stop token(s)."""
    mismatch: MismatchPolicy = "refuse"


class AgentSession:
    """The calls of episode ``k`` of group ``group_id`` (see the module docstring)."""

    def __init__(
        self,
        engine: InferenceEngine,
        model: ChatModel,
        limits: SessionLimits,
        *,
        run_seed: int,
        group_id: int,
        k: int,
        tag: str = "g",
        loop: asyncio.AbstractEventLoop | None = None,
        expected: ExpectedCalls | None = None,
    ) -> None:
        self.engine, self.model, self.limits, self.expected = engine, model, limits, expected
        self.run_seed, self.group_id, self.k, self.tag = run_seed, group_id, k, tag
        self.loop = loop or asyncio.get_running_loop()
        """The engine's event loop: every call runs on it (``agent_endpoint.py`` hands them over)."""
        self.trajectory: Trajectory | None = None
        self.counts: Counter[str] = Counter()
        """``calls``, ``mismatches``, ``segments``, ``tool_calls``, ``malformed_tool_calls``,
        ``sampling_overridden``."""
        self.failure: str | None = None
        """Why the episode cannot be kept (``template_mismatch``, ``engine_abort``), set by a call."""
        self.finish = "agent"
        """``agent`` (the agent returned), or the limit a refused call hit (``max_turns`` / ``context``)."""
        self.last_text = ""
        self._lock = asyncio.Lock()
        self._pending: set[str] = set()
        self._closed = False
        self._awaited = False  # counted in ``expected``: answered, next call (or the end) not yet here

    async def complete(self, request: ChatRequest) -> dict[str, Any]:
        """Answer one call: render, check the record, generate, record, parse tool calls."""
        if request.stream or request.n != 1:
            raise EndpointError(400, "stream and n > 1 are not supported; send stream=false, n=1")
        self._await_next(False)
        async with self._lock:  # one episode is one token sequence: its calls take turns
            call = self.counts["calls"]
            if call >= self.limits.max_turns:
                self.finish = "max_turns"
                raise EndpointError(400, f"episode reached agentic.max_turns ({self.limits.max_turns})", "max_turns")
            prompt = self._extend(self._render(request))
            assert self.trajectory is not None
            completion = await self._generate(request, prompt, call)
            self.counts["calls"] += 1
            ids = completion.token_ids
            closed = completion.finish_reason == "stop" and ids and ids[-1] in self.limits.params.stop_token_ids
            text = self.model.decode(ids[:-1] if closed else ids)
            self._closed = bool(closed)
            self.trajectory.add_model_turn(completion, (), text)  # the next render closes a cut turn
            self.last_text = text
            response = self._response(request, completion, text, len(prompt))
            calls_tool = response["choices"][0]["finish_reason"] == "tool_calls"  # an agent answers a tool call
            self._await_next(calls_tool and self.counts["calls"] < self.limits.max_turns)
            return response

    def sample(self, reward: float, meta: Mapping[str, Any]) -> Sample:
        """The episode's training sample (its last segment); a last turn cut by the length cap is
        closed with the turn-end token (mask 0), as an env episode's is."""
        if self.trajectory is None or not self.counts["calls"]:
            raise ValueError("the agent made no model call")
        if self.trajectory.loss_mask and self.trajectory.loss_mask[-1] == 1 and not self._closed:
            self.trajectory.add_env_tokens(self.limits.params.stop_token_ids[:1])
        uid = f"{self.group_id}-{self.k}"
        return self.trajectory.to_sample(uid, self.group_id, reward, {**meta, "finish_reason": self.finish})

    def abort(self) -> None:
        """Stop this episode's requests on the engines (its agent ended or was stopped); no
        further call is expected."""
        self._await_next(False)
        for request_id in list(self._pending):
            self.engine.abort(request_id)

    def _await_next(self, awaited: bool) -> None:
        if self.expected is not None and awaited != self._awaited:
            self.expected.count += 1 if awaited else -1
        self._awaited = awaited

    def _render(self, request: ChatRequest) -> list[int]:
        try:
            return self.model.render(request.messages, request.tools)
        except ValueError as err:
            raise EndpointError(400, str(err)) from err
        except Exception as err:  # a template error is the caller's input (a role it cannot render)
            raise EndpointError(400, f"messages: the chat template cannot render them ({err})") from err

    def _extend(self, ids: list[int]) -> tuple[int, ...]:
        """Append the prompt's new tokens (mask 0), or apply the mismatch policy."""
        if self.trajectory is None:
            self.trajectory = Trajectory(tuple(ids), 0)
            return self.trajectory.context
        recorded = self.trajectory.context
        if tuple(ids[: len(recorded)]) == recorded:
            self.trajectory.add_env_tokens(ids[len(recorded) :])
            return self.trajectory.context
        self.counts["mismatches"] += 1
        at = next((i for i, (a, b) in enumerate(zip(ids, recorded, strict=False)) if a != b), len(ids))
        if self.limits.mismatch == "refuse":
            self.failure = "template_mismatch"
            raise EndpointError(
                400,
                f"template_mismatch: the rendered messages diverge from this episode's recorded tokens at token "
                f"{at + 1} of {len(recorded)} (the chat template re-renders history differently, or the history "
                "was edited); agentic.template_mismatch: restart starts a new segment instead",
                "template_mismatch",
            )
        self.counts["segments"] += 1
        self.trajectory = Trajectory(tuple(ids), self.trajectory.last_version)
        return self.trajectory.context

    async def _generate(self, request: ChatRequest, prompt: tuple[int, ...], call: int) -> Completion:
        limits, run = self.limits, self.limits.params
        wanted = request.max_completion_tokens or request.max_tokens or limits.turn_tokens
        budget = min(wanted, limits.turn_tokens, limits.max_context - len(prompt))
        if budget < 1:
            self.finish = "context"
            raise EndpointError(400, f"episode reached the context ({limits.max_context} tokens)", "context")
        if request.temperature not in (None, run.temperature) or request.top_p not in (None, run.top_p):
            self.counts["sampling_overridden"] += 1
        stop = tuple(dict.fromkeys(run.stop_token_ids + self.model.stop_ids(request.stop)))
        params = SamplingParams(budget, run.temperature, run.top_p, stop)
        request_id = f"{self.tag}{self.group_id}-e{self.k}-c{call}"
        seed = sample_seed(self.run_seed, self.group_id, self.k * 1009 + call)
        self._pending.add(request_id)
        try:
            completion = await self.engine.generate(
                GenerationRequest(
                    request_id,
                    prompt,
                    params,
                    seed=seed,
                    affinity=f"g{self.group_id}-e{self.k}",
                    session=f"{self.tag}{self.group_id}-e{self.k}",
                )
            )
        except asyncio.CancelledError:
            self.engine.abort(request_id)
            raise
        finally:
            self._pending.discard(request_id)
        if completion.finish_reason == "abort":
            self.failure = "engine_abort"
            raise EndpointError(503, f"request {request_id} was aborted by the engine", "engine_abort")
        return completion

    def _response(self, request: ChatRequest, completion: Completion, text: str, prompt_len: int) -> dict[str, Any]:
        tools = request.tools or []
        parsed = self.model.parser(text, tools, f"call_{self.group_id}_{self.k}_{self.counts['calls']}")
        self.counts["tool_calls"] += len(parsed.tool_calls)
        self.counts["malformed_tool_calls"] += parsed.malformed
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = list(parsed.tool_calls)
        finish = "tool_calls" if parsed.tool_calls else "stop" if completion.finish_reason == "stop" else "length"
        n = len(completion.token_ids)
        return {
            "id": f"chatcmpl-{completion.request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(getattr(request, "model", None) or "sluice"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n},
        }

"""Where ``LLMProxy`` sends one request: the per-replica bookkeeping it routes by, the
least-outstanding-tokens choice with optional prompt affinity, and the continuation of a request
moved to another replica.

- ``ReplicaState``: one replica as the proxy sees it (accepting or not, outstanding tokens, the
  requests on it, slots reserved for released requests); ``Flight``: one request in the proxy.
- ``AffinityRouter``: the accepting replica with the fewest outstanding tokens; without prompt
  replication, requests sharing an ``affinity`` key (a prompt's samples) stick to the replica the
  first of them went to while any of them is there (prefix sharing).
- ``continuation``: prompt + tokens so far, the remaining budget, a fresh sampling stream.

It holds no requests and awaits nothing: admission order, slots and weight updates are the proxy's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.api import GenerationRequest, Replica
from sluice.rollout.single_turn import sample_seed


@dataclass(eq=False)
class ReplicaState:
    replica_id: int
    replica: Replica
    version: int
    accepting: bool = False
    outstanding: float = 0.0
    reserved: int = 0  # slots given to requests the longest-first queue released, not yet running
    flights: set[str] = field(default_factory=set)
    busy_since: float | None = None  # since when it has had a request running (None: idle)


@dataclass(eq=False)
class Flight:
    request: GenerationRequest
    replica_id: int | None = None
    user_aborted: bool = False
    displaced: bool = False
    predicted: float | None = None  # response length, when a length predictor orders requests
    tail: bool = False  # predicted to be in the long tail (skewness-aware dispatch)
    waiting: asyncio.Future[Any] | None = None  # its turn in the longest-first queue


class AffinityRouter:
    """Least outstanding tokens, with prompt affinity when ``prompt_replication`` is off."""

    def __init__(self, prompt_replication: bool = True) -> None:
        self.prompt_replication = prompt_replication
        self._affinity: dict[str, tuple[int, int]] = {}  # key -> (replica id, requests in flight)

    def pick(self, request: GenerationRequest, candidates: Sequence[ReplicaState]) -> ReplicaState | None:
        """The replica among ``candidates`` for ``request`` (``None`` when there is none)."""
        if not candidates:
            return None
        key = None if self.prompt_replication else request.affinity
        if key is not None and key in self._affinity:
            replica_id, count = self._affinity[key]
            for state in candidates:
                if state.replica_id == replica_id:
                    self._affinity[key] = (replica_id, count + 1)
                    return state
        state = min(candidates, key=lambda s: (s.outstanding, s.replica_id))
        if key is not None:
            self._affinity[key] = (state.replica_id, 1)
        return state

    def release(self, key: str | None, replica_id: int) -> None:
        """One request of ``key`` left ``replica_id``."""
        entry = self._affinity.get(key) if key is not None else None
        if key is not None and entry is not None and entry[0] == replica_id:
            if entry[1] <= 1:
                del self._affinity[key]
            else:
                self._affinity[key] = (replica_id, entry[1] - 1)

    def forget(self, replica_id: int) -> None:
        """A replica left the fleet: its prompts may go anywhere."""
        self._affinity = {k: v for k, v in self._affinity.items() if v[0] != replica_id}


def continuation(request: GenerationRequest, tokens: Sequence[int]) -> GenerationRequest:
    """The rest of ``request`` after ``tokens``: prompt + tokens so far, the remaining length, and a
    fresh sampling stream (the new replica's counter starts at 0)."""
    if not tokens:
        return request
    params = request.params
    rest = type(params)(params.max_new_tokens - len(tokens), params.temperature, params.top_p, params.stop_token_ids)
    return GenerationRequest(
        request.request_id,
        request.prompt_ids + tuple(tokens),
        rest,
        seed=sample_seed(request.seed, len(tokens), 1),
        affinity=request.affinity,
        session=request.session,
    )

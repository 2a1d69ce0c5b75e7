"""Small deterministic fakes, one per Protocol, for unit tests only.

Product code never imports this module. The simulation engine for benchmarks lives in
``sluice/sim`` (a product feature), not here.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.api import (
    Algorithm,
    Completion,
    GenerationRequest,
    LossInputs,
    LossOutputs,
    MicroBatch,
    ReplicaLost,
    Sample,
)

if TYPE_CHECKING:  # reward worker processes unpickle FaultyReward from here: no torch at import
    import torch


class FakeInferenceEngine:
    """Answers each request with a scripted token sequence derived from its seed.

    Tokens are ``(seed + i) % vocab`` for ``i < seed % max_new_tokens + 1``, stopping early at a
    stop token; log-probs are ``-0.5`` and versions the engine's current version.
    """

    def __init__(self, vocab: int = 16, version: int = 0) -> None:
        self.vocab = vocab
        self.version = version
        self.requests: list[GenerationRequest] = []
        self.aborted: set[str] = set()
        self.paused = False
        self.loaded: list[int] = []

    async def generate(self, request: GenerationRequest) -> Completion:
        self.requests.append(request)
        await asyncio.sleep(0)
        length = request.seed % request.params.max_new_tokens + 1
        tokens: list[int] = []
        reason = "length"
        for i in range(length):
            tok = (request.seed + i) % self.vocab
            tokens.append(tok)
            if tok in request.params.stop_token_ids:
                reason = "stop"
                break
        if request.request_id in self.aborted:
            tokens, reason = [], "abort"
        return Completion(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            token_ids=tuple(tokens),
            logprobs=(-0.5,) * len(tokens),
            versions=(self.version,) * len(tokens),
            finish_reason=reason,  # type: ignore[arg-type]
        )

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, weights: Mapping[str, Any], version: int, mode: str = "interrupt") -> None:
        self.version = version
        self.loaded.append(version)

    def stats(self) -> dict[str, float]:
        return {"requests": float(len(self.requests)), "version": float(self.version)}

    def weights_checksum(self) -> float:
        return float(self.version)


class FakeTrainEngine:
    """A ``TrainEngine`` with one scalar weight ``w`` and plain-float arithmetic, recording its calls.

    A micro-batch's loss is ``-w · Σ advantage · loss_mask / mb.normaliser`` over its response
    tokens, so ``accumulate`` adds ``-Σ advantage · loss_mask / mb.normaliser`` to ``grad``;
    ``finish_step`` multiplies ``grad`` by ``grad_scale`` and takes ``w -= lr · grad``. A skipped
    micro-batch or a wrong scale therefore shows in ``w``. ``calls`` lists ``("begin_step",)``,
    ``("accumulate", sample uids)``, ``("finish_step", grad_scale)`` and ``("logprobs", sample
    uids)`` in order; ``logprobs`` are the behaviour ones shifted by ``w``.
    """

    def __init__(self, lr: float = 1.0) -> None:
        self.lr = lr
        self.w = 0.0
        self.grad = 0.0
        self.steps = 0
        self.calls: list[tuple[object, ...]] = []

    def begin_step(self) -> None:
        self.calls.append(("begin_step",))
        self.grad = 0.0

    def accumulate(self, mb: MicroBatch, algorithm: Algorithm) -> None:
        self.calls.append(("accumulate", tuple(s.uid for s in mb.samples)))
        for s, adv in zip(mb.samples, mb.advantages, strict=True):
            self.grad -= sum(a * m for a, m in zip(adv, s.loss_mask, strict=True)) / mb.normaliser

    def finish_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        self.calls.append(("finish_step", grad_scale))
        self.grad *= grad_scale
        self.w -= self.lr * self.grad
        self.steps += 1
        return {"loss": -self.w * self.grad, "grad_norm": abs(self.grad)}

    def logprobs(self, samples: Sequence[Sample], temperature: float) -> list[list[float]]:
        self.calls.append(("logprobs", tuple(s.uid for s in samples)))
        return [[x + self.w for x in s.behav_logprobs] for s in samples]

    def export_weights(self) -> dict[str, torch.Tensor]:
        import torch

        return {"w": torch.tensor([self.w], dtype=torch.float64)}

    def save(self, path: str, *, optimizer: bool = True) -> None:
        state = {"w": self.w, "steps": self.steps} if optimizer else {"w": self.w}
        Path(path, "fake_engine.json").write_text(json.dumps(state))

    def load(self, path: str) -> None:
        state = json.loads(Path(path, "fake_engine.json").read_text())
        self.w, self.steps = state["w"], state["steps"]


class FakeAlgorithm:
    """Advantage = reward for every token; loss = 0 with a token count."""

    whole_batch_advantages = False
    uses_entropy = False
    uses_reference = False

    def normaliser(self, samples: Sequence[Sample]) -> float:
        return float(max(sum(sum(s.loss_mask) for s in samples), 1))

    def advantages(self, samples: Sequence[Sample]) -> list[list[float]]:
        return [[s.reward] * len(s.response_ids) for s in samples]

    def loss(self, inputs: LossInputs) -> LossOutputs:
        return LossOutputs(loss=inputs.logp.sum() * 0.0, stats={"tokens": float(inputs.mask.sum())})


class FakeLengthPredictor:
    """``LengthPredictor`` that predicts from a table of prompt -> length (``default`` otherwise)
    and records what it observed."""

    def __init__(self, table: Mapping[tuple[int, ...], float], default: float = 0.0) -> None:
        self.table = dict(table)
        self.default = default
        self.observed: list[tuple[tuple[int, ...], int]] = []

    def predict(self, prompts: Sequence[Sequence[int]]) -> list[float]:
        return [self.table.get(tuple(p), self.default) for p in prompts]

    def observe(self, prompt_ids: Sequence[int], length: int) -> None:
        self.observed.append((tuple(prompt_ids), length))


class RecordingEngine:
    """Wraps an ``InferenceEngine`` (a ``SimEngine`` in the proxy tests) and records the requests
    it served, the completions it returned and the most it ran at once."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.served: list[str] = []
        self.completions: list[Completion] = []
        self.running = 0
        self.peak = 0

    async def generate(self, request: GenerationRequest) -> Completion:
        self.served.append(request.request_id)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            result: Completion = await self.engine.generate(request)
            self.completions.append(result)
            return result
        finally:
            self.running -= 1

    def __getattr__(self, name: str) -> Any:  # abort, pause, resume, update_weights, stats
        return getattr(self.engine, name)


class ThrottledEngine:
    """Wraps a real ``InferenceEngine`` as a replica of fixed capacity: one request at a time, each
    first holding the replica for ``delay_s(version)`` seconds (the engine's weight version), so a
    test slows generation on purpose for some versions and one more replica adds capacity. An abort
    while a request waits its turn returns it at once with no tokens."""

    def __init__(self, engine: Any, delay_s: Any) -> None:
        self.engine = engine
        self.delay_s = delay_s
        self._turn = asyncio.Lock()
        self._aborted: set[str] = set()

    async def generate(self, request: GenerationRequest) -> Completion:
        rid = request.request_id
        async with self._turn:
            if rid not in self._aborted:
                await asyncio.sleep(self.delay_s(self.engine.stats()["version"]))
            if rid in self._aborted:
                self._aborted.discard(rid)
                return Completion(rid, request.prompt_ids, (), (), (), "abort")
            result: Completion = await self.engine.generate(request)
            return result

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        self.engine.abort(request_id)

    def __getattr__(self, name: str) -> Any:  # pause, resume, update_weights, stats, version, checksum
        return getattr(self.engine, name)


def length_reward(response: str, **_: Any) -> float:
    """A reward with signal on any model: longer responses score higher (capped at 1)."""
    return min(len(response) / 8.0, 1.0)


def paced_length_reward(response: str, **kw: Any) -> float:
    """``length_reward`` after a fixed 50 ms, as a remote scorer would: a step's 16 scores on two
    reward workers take ≈ 0.4 s, so its groups reach the queue spread over that time and a
    streaming trainer starts its first micro-batch well before the last group is stored, however
    fast the engine and however loaded the machine (the golden test's η = 0 overlap check; the
    scores, and so every number, are ``length_reward``'s)."""
    time.sleep(0.05)
    return length_reward(response, **kw)


def matches_reward(response: str, answer: str = "", **_: Any) -> bool:
    """A reward as people write it: ``pred == gt``, a ``bool``."""
    return response == answer


class FakePipeline:
    """An ``Pipeline`` whose rollouts sleep for a scripted latency (seconds) per group.

    ``latency(group_id)`` and ``discard(group_id)`` script each group (a discarded group is
    reported as failed by ``failed_by`` when that is set); a group's version is the
    engine version when its wave started. ``steps`` records the group ids each step trained;
    ``aborted`` the groups ``abort_groups`` stopped (each then reports its reason).
    """

    def __init__(
        self,
        latency: Any,
        discard: Any = None,
        sync_s: float = 0.0,
        slots: int | None = None,
        failed_by: str | None = None,
    ) -> None:
        self.latency = latency
        self.discard = discard or (lambda gid: False)
        self.failed_by = failed_by
        self.sync_s = sync_s
        self.slots = asyncio.Semaphore(slots) if slots else None
        """``slots``: groups generating at once, like an engine's batch; the others wait, and a
        group's version is then the engine version when it got its slot (it may be newer than
        the one it was admitted at)."""
        self.engine_version = 0
        self.trainer_version = 0
        self.steps: list[list[int]] = []
        self.aborted: dict[int, str] = {}
        self._running: dict[int, asyncio.Task[Any]] = {}
        self._prompt = 0

    def next_prompt(self) -> Any:
        from sluice.api import PromptItem

        self._prompt += 1
        return PromptItem(self._prompt, f"p{self._prompt}", (1,), {})

    async def rollout_wave(self, groups: Sequence[Any]) -> Any:
        from sluice.api import GroupReport

        version = self.engine_version

        async def one(gid: int) -> GroupReport:
            try:
                if gid in self.aborted:  # stopped before its wave started
                    raise asyncio.CancelledError
                if self.slots is None:
                    await asyncio.sleep(self.latency(gid))
                    started = version
                else:
                    async with self.slots:
                        started = self.engine_version
                        await asyncio.sleep(self.latency(gid))
            except asyncio.CancelledError:
                if gid not in self.aborted:
                    raise
                return GroupReport(gid, -1, 2, 0, (), discard_reason=self.aborted[gid])
            reason = "scripted" if self.discard(gid) else None
            failed = self.failed_by if reason else None
            return GroupReport(
                gid,
                started,
                num_samples=2,
                response_tokens=10,
                rewards=(0.0, 1.0),
                discard_reason=reason,
                sample_versions=(started, started),
                failed_by=failed,
                error=f"ValueError: group {gid}" if failed else "",
            )

        tasks = {gid: asyncio.ensure_future(one(gid)) for _, gid in groups}
        self._running.update(tasks)
        for done in asyncio.as_completed(list(tasks.values())):
            yield await done

    async def abort_groups(self, group_ids: list[int], reason: str) -> None:
        for gid in group_ids:
            self.aborted[gid] = reason
            if gid in self._running:
                self._running[gid].cancel()

    async def begin_step(self) -> None:
        self.steps.append([])

    async def train_groups(self, group_ids: list[int]) -> None:
        self.steps[-1].extend(group_ids)

    async def finish_step(self) -> dict[str, float]:
        self.trainer_version += 1
        return {"loss": 0.0}

    async def sync_weights(self, version: int) -> dict[str, float]:
        await asyncio.sleep(self.sync_s)
        self.engine_version = version
        return {}


def short_only_reward(response: str, *, bucket: str = "short", **_: Any) -> float:
    """``length_reward`` on short prompts, a constant 0 on long ones: long groups carry no signal."""
    return length_reward(response) if bucket == "short" else 0.0


@dataclass(frozen=True)
class FaultyReward:
    """A ``RewardFn`` that fails on long prompts (``bucket='long'``; on every prompt when
    ``always``) and otherwise returns ``length_reward``. ``mode`` picks the failure: ``raise``,
    ``nan``, ``text`` (returns a string), ``exit`` (ends its process) or ``hang`` (sleeps
    ``hang_s``). Picklable, so it runs in reward processes."""

    mode: str
    always: bool = False
    hang_s: float = 60.0

    def __call__(self, response: str, *, bucket: str = "short", **_: Any) -> Any:
        if not self.always and bucket != "long":
            return length_reward(response)
        return _fail(self.mode, self.hang_s)


@dataclass(frozen=True)
class FlakyReward:
    """``length_reward``, failing (``FaultyReward``'s ``mode``) on the share of prompts whose
    ``answer`` hashes below ``share``: deterministic, the same prompts in every run and process."""

    share: float
    mode: str = "raise"

    def __call__(self, response: str, *, answer: str = "", **_: Any) -> Any:
        if zlib.crc32(str(answer).encode()) % 1000 >= self.share * 1000:
            return length_reward(response)
        return _fail(self.mode, 60.0)


def raising_reward(response: str, **_: Any) -> float:
    """A reward that always raises (``reward.fn=fakes:raising_reward``)."""
    raise ValueError("scripted reward failure")


def _fail(mode: str, hang_s: float) -> Any:
    """A scripted reward failure: ``raise``, ``nan``, ``text``, ``exit`` (the reward's process
    ends at once, as a crash would) or else a hang of ``hang_s`` seconds."""
    if mode == "exit":
        os._exit(3)
    if mode == "raise":
        raise ValueError("scripted reward failure")
    if mode == "nan":
        return float("nan")
    if mode == "text":
        return "1.0"
    time.sleep(hang_s)
    return 1.0


async def async_length_reward(response: str, **fields: Any) -> float:
    """``length_reward`` as a coroutine (async rewards are part of the ``RewardFn`` contract)."""
    await asyncio.sleep(0)
    return length_reward(response, **fields)


class FakeEnv:
    """A scripted ``Env``: ``reset`` answers ``"start"``, step ``i`` answers ``"o<i>"`` after
    ``delay_s(i)`` seconds and is done after ``turns`` steps, with reward 1 if the first action
    was non-empty. ``fail`` = (step, "raise" | "hang") makes that step raise or never return.
    ``actions`` records what the model sent; ``log`` the (event, time) of every call."""

    def __init__(self, turns: int = 3, delay_s: Any = None, fail: tuple[int, str] | None = None) -> None:
        self.turns = turns
        self.delay_s = delay_s or (lambda step: 0.0)
        self.fail = fail
        self.actions: list[str] = []
        self.log: list[tuple[str, float]] = []
        self.closed = False

    async def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> str:
        self.log.append(("reset", asyncio.get_running_loop().time()))
        self.seed = seed
        return "start"

    async def step(self, action: str) -> Any:
        from sluice.api import EnvStep

        step = len(self.actions)
        self.actions.append(action)
        self.log.append(("step", asyncio.get_running_loop().time()))
        if self.fail is not None and self.fail[0] == step:
            if self.fail[1] == "raise":
                raise RuntimeError(f"scripted env failure at step {step}")
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay_s(step))
        done = step + 1 >= self.turns
        return EnvStep(f"o{step + 1}", float(bool(self.actions[0])) if done else 0.0, done)

    async def close(self) -> None:
        self.closed = True


def verl_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict:
    """A reward in verl's ``compute_score`` convention, returning verl's dict: 1.0 for an exact
    answer, plus ``extra_info["bonus"]`` (0 without one); ``data_source`` echoed in the dict."""
    bonus = (extra_info or {}).get("bonus", 0.0)
    return {"score": float(solution_str.strip() == str(ground_truth)) + bonus, "source": data_source}


tripled_length_reward = lambda response, **_: 3.0 * length_reward(response)  # noqa: E731
"""A reward reachable by import path that does not pickle by reference (a lambda): the reward
pool must import it by path in its processes (``reward.fn=fakes:tripled_length_reward``)."""

NOT_CALLABLE = 42
"""An import path that resolves to a non-callable (``reward.fn=fakes:NOT_CALLABLE``)."""


class FakeWeightSync:
    """A ``WeightSync`` that keeps every published version (copied) and records the calls:
    ``published`` lists each version with its tensor names, ``fetches`` the versions asked for."""

    def __init__(self) -> None:
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.published: list[tuple[int, tuple[str, ...]]] = []
        self.fetches: list[int] = []

    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        self.versions[version] = {name: t.detach().clone() for name, t in named_tensors.items()}
        self.published.append((version, tuple(sorted(named_tensors))))

    def fetch(self, version: int) -> Mapping[str, torch.Tensor]:
        self.fetches.append(version)
        return self.versions[version]

    def latest_version(self) -> int:
        return max(self.versions, default=0)


class FakeStorageUnit:
    """A ``StorageUnit`` over plain dicts that records each ``write`` / ``read`` / ``drop``
    (``calls``): what a queue asks of its storage, with none of the packing of the real one."""

    def __init__(self) -> None:
        from sluice.api import RowMeta

        self._row_meta = RowMeta
        self.rows: dict[int, dict[str, Any]] = {}
        self.metas: dict[int, Any] = {}
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def write(self, indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Sequence[Any] | None = None):
        self.calls.append(("write", tuple(indices)))
        for k, i in enumerate(indices):
            if i not in self.metas:
                self.metas[i] = meta[k] if meta is not None else self._row_meta(i, i, 0, 0)
            self.rows.setdefault(i, {}).update({name: values[k] for name, values in columns.items()})
        return [self.metas[i] for i in indices]

    def read(self, indices: Sequence[int], columns: Sequence[str]) -> dict[str, Sequence[Any]]:
        self.calls.append(("read", tuple(indices)))
        return {name: [self.rows[i][name] for i in indices] for name in columns}

    def drop(self, indices: Sequence[int]) -> int:
        self.calls.append(("drop", tuple(indices)))
        gone = [i for i in indices if self.rows.pop(i, None) is not None]
        for i in gone:
            self.metas.pop(i, None)
        return len(gone)

    def catalog(self) -> list[tuple[Any, tuple[str, ...]]]:
        return [(self.metas[i], tuple(self.rows[i])) for i in sorted(self.rows)]

    def snapshot(self) -> dict[str, Any]:
        columns: dict[str, dict[str, list[Any]]] = {}
        for i in sorted(self.rows):
            for name, value in self.rows[i].items():
                col = columns.setdefault(name, {"indices": [], "values": []})
                col["indices"].append(i)
                col["values"].append(value)
        fields = ("index", "group_id", "version", "num_tokens", "group_size", "partition")
        meta = [[getattr(self.metas[i], f) for f in fields] for i in sorted(self.metas)]
        return {"meta": meta, "columns": columns, "freed": []}

    def restore(self, state: dict[str, Any]) -> None:
        metas = [self._row_meta(*row) for row in state["meta"]]
        self.write([m.index for m in metas], {}, metas)
        for name, col in state["columns"].items():
            self.write(col["indices"], {name: list(col["values"])})

    def stats(self) -> dict[str, Any]:
        return {"rows": len(self.rows)}


class FakeQueueClient:
    """A ``QueueClient`` over plain dicts: rows in index order, a task gets the rows holding all
    its columns that it has not consumed, never waits (it returns what is ready). ``gets`` records
    every read as (task, rows asked for, rows returned)."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, Any]] = {}
        self.metas: dict[int, Any] = {}
        self.tasks: dict[str, set[int]] = {}
        self.gets: list[tuple[str, tuple[int, ...] | None, tuple[int, ...]]] = []
        self.closed = False

    def register_task(self, task: str, input_columns: Sequence[str]) -> None:
        self.tasks.setdefault(task, set())

    def put(self, indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Any = None, *, partition=None):
        for k, i in enumerate(indices):
            self.rows.setdefault(i, {}).update({name: values[k] for name, values in columns.items()})
            if meta is not None:
                self.metas.setdefault(i, meta[k])

    def get(self, task: str, columns: Sequence[str], batch_size: int, *, indices=None, **_: Any) -> Any:
        from sluice.api import Batch

        wanted = sorted(self.rows) if indices is None else list(indices)
        ready = [i for i in wanted if i in self.rows and i not in self.tasks[task]]
        chosen = [i for i in ready if all(c in self.rows[i] for c in columns)][:batch_size]
        self.tasks[task].update(chosen)
        self.gets.append((task, None if indices is None else tuple(indices), tuple(chosen)))
        cols = {c: [self.rows[i][c] for i in chosen] for c in columns}
        return Batch(tuple(chosen), cols, tuple(self.metas[i] for i in chosen))

    def clear(self, indices: Sequence[int] | None = None) -> int:
        gone = list(self.rows) if indices is None else [i for i in indices if i in self.rows]
        for i in gone:
            del self.rows[i]
        return len(gone)

    def snapshot(self) -> dict[str, Any]:
        return {"rows": {i: dict(r) for i, r in self.rows.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.rows = {i: dict(r) for i, r in state["rows"].items()}

    def stats(self) -> dict[str, Any]:
        return {"rows": len(self.rows)}

    def close(self) -> None:
        self.closed = True


class FakeAsyncQueueClient:
    """``FakeQueueClient``'s verbs as coroutines (an ``AsyncQueueClient``); ``sync`` is the fake
    it wraps, so a test reads what was written."""

    def __init__(self, sync: FakeQueueClient | None = None) -> None:
        self.sync = sync or FakeQueueClient()

    async def register_task(self, task: str, input_columns: Sequence[str]) -> None:
        self.sync.register_task(task, input_columns)

    async def put(self, indices, columns, meta=None, *, partition=None) -> None:
        self.sync.put(indices, columns, meta, partition=partition)

    async def get(self, task: str, columns: Sequence[str], batch_size: int, **kwargs: Any) -> Any:
        return self.sync.get(task, columns, batch_size, **kwargs)

    async def clear(self, indices: Sequence[int] | None = None) -> int:
        return self.sync.clear(indices)

    async def snapshot(self) -> dict[str, Any]:
        return self.sync.snapshot()

    async def restore(self, state: dict[str, Any]) -> None:
        self.sync.restore(state)

    async def stats(self) -> dict[str, Any]:
        return self.sync.stats()

    async def close(self) -> None:
        self.sync.close()


class FakeReplica:
    """A ``Replica`` (every verb a coroutine) over a ``FakeInferenceEngine``; ``updates`` records
    each weight update as (version, mode). With ``hold``, requests wait on it until ``release()``;
    ``kill()`` makes it a replica whose process died: the requests it holds and every later verb
    raise ``ReplicaLost``."""

    def __init__(self, engine: FakeInferenceEngine | None = None, *, hold: bool = False) -> None:
        self.engine = engine or FakeInferenceEngine()
        self.updates: list[tuple[int, str]] = []
        self.hold, self.holding, self.dead = hold, 0, False
        self._gate = asyncio.Event()

    def release(self) -> None:
        self._gate.set()

    def kill(self) -> None:
        self.dead = True
        self._gate.set()

    def _alive(self) -> None:
        if self.dead:
            raise ReplicaLost("fake replica killed")

    async def generate(self, request: GenerationRequest) -> Completion:
        self._alive()
        if self.hold:
            self.holding += 1
            await self._gate.wait()
            self._alive()
        return await self.engine.generate(request)

    async def abort(self, request_id: str) -> None:
        self._alive()
        self.engine.aborted.add(request_id)

    async def pause(self) -> None:
        self._alive()
        self.engine.paused = True

    async def resume(self) -> None:
        self._alive()
        self.engine.paused = False

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int, mode: str) -> None:
        self._alive()
        self.updates.append((version, mode))
        self.engine.version = version

    async def stats(self) -> dict[str, float]:
        self._alive()
        return {"version": float(self.engine.version)}


class FakeToolEnv(FakeEnv):
    """A ``ToolEnv``: ``FakeEnv`` that also declares one tool, ``echo``."""

    TOOLS = ({"name": "echo", "description": "repeats its argument", "parameters": {"type": "object"}},)

    def tools(self) -> Sequence[Mapping[str, Any]]:
        return self.TOOLS


class ScriptedEvalEngine:
    """An ``InferenceEngine`` for evaluation tests: ``script[p]`` answers prompts starting with
    token ``p``: its first token to the greedy request (temperature 0), the next ones to the
    sampled requests in arrival order; one token per response."""

    def __init__(self, script: Mapping[int, Sequence[int]]) -> None:
        self.script = script
        self.requests: list[GenerationRequest] = []
        self._sampled: dict[int, int] = {}

    async def generate(self, request: GenerationRequest) -> Completion:
        self.requests.append(request)
        prompt = request.prompt_ids[0]
        turn = 0
        if request.params.temperature > 0:
            turn = self._sampled[prompt] = self._sampled.get(prompt, 0) + 1
        token = self.script[prompt][turn]
        return Completion(request.request_id, request.prompt_ids, (token,), (-0.5,), (0,), "stop")


class DigitTokenizer:
    """Decodes token ids as their decimal digits (``[2] -> "2"``), for ``ScriptedEvalEngine``."""

    eos_token_id = 99

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(str(i) for i in ids)


def half_digit_reward(response: str, **_: Any) -> float:
    """Reward of a one-digit response ``d``: ``d / 2`` (``2`` is the only correct answer)."""
    return int(response) / 2


CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluate a*b, a+b or a-b",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


async def calculator_agent(client: Any, row: dict[str, Any]) -> float | None:
    """An OpenAI-client agent of the calculator task (up to 3 calls): tool calls are answered with
    ``sluice.rollout.envs.calculator.calculate``; reward 1 for ``a<product>``. ``row["stall"]``
    seconds of sleep first; ``row["raise"]`` makes it raise."""
    from sluice.rollout.envs.calculator import calculate

    if row.get("raise"):
        raise RuntimeError("agent bug")
    await asyncio.sleep(float(row.get("stall", 0.0)))
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{row['a']}*{row['b']}"}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="tiny", messages=messages, tools=[CALCULATOR_TOOL])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(message.content == f"a{row['a'] * row['b']}")
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments)["expression"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    return 0.0


def sync_calculator_agent(client: Any, row: dict[str, Any]) -> float:
    """A synchronous agent: one call with an ``openai.OpenAI`` client; records its thread's name."""
    import threading

    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"{row['a']}*1"}])
    SYNC_AGENT_THREADS.append(threading.current_thread().name)
    return float(bool(reply.choices[0].message.content))


SYNC_AGENT_THREADS: list[str] = []


async def two_turn_agent(client: Any, row: dict[str, Any]) -> float:
    """Two calls whatever the model says: its first reply goes back in the history, then ``1``."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": str(row["a"])}]
    for _ in range(2):
        reply = await client.chat.completions.create(model="tiny", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "1"}]
    return 1.0


async def deferring_agent(client: Any, row: dict[str, Any]) -> None:
    """One call, then leaves the reward to the run's reward function."""
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": str(row["a"])}])


class ScriptedTurnsEngine:
    """An ``InferenceEngine`` whose n-th request samples ``turns[n]`` (token ids, as given):
    log-probs ``-0.1 * (i + 1)``, version ``version``, ``stop`` when the last id is a stop token."""

    def __init__(self, turns: Sequence[Sequence[int]], version: int = 3) -> None:
        self.turns, self.version = [tuple(t) for t in turns], version
        self.requests: list[GenerationRequest] = []
        self.completions: list[Completion] = []

    async def generate(self, request: GenerationRequest) -> Completion:
        tokens = self.turns[len(self.requests)]
        self.requests.append(request)
        reason = "stop" if tokens[-1] in request.params.stop_token_ids else "length"
        completion = Completion(request.request_id, request.prompt_ids, tokens,
                                tuple(-0.1 * (i + 1) for i in range(len(tokens))), (self.version,) * len(tokens),
                                reason)  # type: ignore[arg-type]  # fmt: skip
        self.completions.append(completion)
        return completion

    def abort(self, request_id: str) -> None:
        pass


async def pid_agent(client: Any, row: dict[str, Any]) -> float:
    """One call; returns the id of the process it ran in (agents in a process of their own)."""
    import os

    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": str(row["a"])}])
    return float(os.getpid())

"""A scalar reward model (``reward.model``) scoring a run's responses: its workers and their batches.

``rm_input_ids`` is the one way a reward model reads a (prompt, response) pair, in training
(``sluice rm``) and in a run: the prompt as the policy saw it (a chat template's text already holds
its special tokens; a plain prompt gets the tokenizer's own, e.g. BOS), the response, then ``eos``.
A ``RewardModelWorker`` holds one copy of the model on its own torch threads and scores id rows in
length-sorted chunks of ``reward.model_token_budget`` positions (``engines/scalar_model.py``); it is
an object in the rollout worker's process (``run.backend: local``) or a Ray actor each
(``run.backend: ray``: its own process, CPUs and GPUs from ``resources.reward_model``).
``RewardModelPool`` is what a rollout worker awaits for each finished group: it tokenises the
group's texts, queues them, and each worker takes the queued groups together up to the token
budget (a batch of several groups when they finish together); a worker actor that dies is
replaced and its batch run again once, a second death fails the batch's groups
(``reward_error:reward_model``, counted and discarded like every reward failure).

Deliberately not here: combining the score with the rule reward (``rewards/combine.py``), when a
group is scored (``rollout/groups.py``), training a reward model (``trainer/rm.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.api import RewardFailure

log = logging.getLogger(__name__)

NAME = "reward_model"
"""The name a reward model's failures are counted under (``reward_error:reward_model``)."""


def rm_input_ids(tokenizer: Any, prompt: str, response: str, templated: bool) -> list[int]:
    """The ids a reward model scores: ``prompt`` (with the tokenizer's special tokens unless a chat
    template rendered it), ``response``, ``eos``."""
    head = list(tokenizer(prompt, add_special_tokens=not templated)["input_ids"]) if prompt or not templated else []
    return [*head, *tokenizer(response, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]


def chat_templated(tokenizer: Any, mode: str) -> bool:
    """Whether prompts are rendered by a chat template (``data.chat_template``, as ``data/chat.py``)."""
    return mode == "on" or (mode == "auto" and bool(getattr(tokenizer, "chat_template", None)))


@dataclass(frozen=True)
class RewardModelSpec:
    """What a run's reward-model workers are built from (picklable: Ray actors receive it)."""

    path: str
    token_budget: int = 4096
    workers: int = 1
    threads: int = 1
    chat_template: str = "auto"
    actors: bool = False
    """Ray actors (``run.backend: ray``) instead of objects in the rollout worker's process."""
    actor_options: tuple[tuple[str, Any], ...] = ()
    """Ray options of each actor (``num_cpus``, ``num_gpus``)."""
    timeout_s: float = 300.0


class RewardModelWorker:
    """One copy of a reward model: ``score(rows)`` → one float per id row."""

    def __init__(self, path: str | Path, token_budget: int = 4096, threads: int | None = None) -> None:
        import torch

        from sluice.engines.hf_model import load_scalar_model, on_device
        from sluice.engines.scalar_model import pad_id_of

        if threads is not None:
            torch.set_num_threads(threads)
        self.model = on_device(load_scalar_model(path))
        self.model.requires_grad_(False)
        self.pad_id = pad_id_of(self.model)
        self.token_budget = token_budget

    def score(self, rows: Sequence[Sequence[int]]) -> list[float]:
        from sluice.engines.scalar_model import scores

        return scores(self.model, rows, self.pad_id, self.token_budget)

    def ping(self) -> bool:
        return True


class RewardModelPool:
    """The reward model as the rollout worker sees it: ``await pool.score(texts)``."""

    def __init__(self, spec: RewardModelSpec) -> None:
        from sluice.engines.hf_model import load_tokenizer
        from sluice.engines.model_folder import check_reward_model_dir

        check_reward_model_dir(spec.path)
        self.spec = spec
        self.name = NAME
        self.tokenizer = load_tokenizer(spec.path)
        self.templated = chat_templated(self.tokenizer, spec.chat_template)
        self.workers: list[Any] = [self._start() for _ in range(spec.workers)]
        self._pending: list[tuple[list[list[int]], asyncio.Future[list[float]]]] = []
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loops: list[asyncio.Task[None]] = []
        self.counts: Counter[str] = Counter()
        self.seconds = 0.0

    def _start(self) -> Any:
        if not self.spec.actors:
            return RewardModelWorker(self.spec.path, self.spec.token_budget)
        import ray

        actor = ray.remote(RewardModelWorker).options(**dict(self.spec.actor_options))
        return actor.remote(self.spec.path, self.spec.token_budget, self.spec.threads)

    def ids(self, texts: Sequence[tuple[str, str]]) -> list[list[int]]:
        return [rm_input_ids(self.tokenizer, p, r, self.templated) for p, r in texts]

    async def score(self, texts: Sequence[tuple[str, str]]) -> list[float]:
        """The scores of one group's (prompt, response) texts; ``RewardFailure`` when its batch failed."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # one serving task per worker, on the loop that awaits the scores
            self._loop, self._wake = loop, asyncio.Event()
            self._loops = [asyncio.ensure_future(self._serve(k)) for k in range(len(self.workers))]
        done: asyncio.Future[list[float]] = asyncio.get_running_loop().create_future()
        self._pending.append((self.ids(texts), done))
        self._wake.set()
        return await done

    def _take(self) -> list[tuple[list[list[int]], asyncio.Future[list[float]]]]:
        """Queued groups, oldest first, up to the token budget (at least one)."""
        taken, tokens = [], 0
        while self._pending:
            size = sum(len(r) for r in self._pending[0][0])
            if taken and tokens + size > self.spec.token_budget:
                break
            taken.append(self._pending.pop(0))
            tokens += size
        return taken

    async def _serve(self, k: int) -> None:
        assert self._wake is not None
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._take()
            rows = [row for group, _ in batch for row in group]
            started = time.perf_counter()
            try:
                values = await self._call(k, rows)
            except RewardFailure as failure:
                for _, done in batch:
                    if not done.done():
                        done.set_exception(failure)
                continue
            self.seconds += time.perf_counter() - started
            self.counts["rm_batches"] += 1
            self.counts["rm_rows"] += len(rows)
            at = 0
            for group, done in batch:
                if not done.done():
                    done.set_result(values[at : at + len(group)])
                at += len(group)

    async def _call(self, k: int, rows: list[list[int]]) -> list[float]:
        """Worker ``k``'s scores of ``rows``: a dead actor is replaced and the call run once more."""
        for attempt in (0, 1):
            try:
                if not self.spec.actors:
                    return await asyncio.to_thread(self.workers[k].score, rows)
                return list(await asyncio.wait_for(self.workers[k].score.remote(rows), self.spec.timeout_s))
            except Exception as err:  # deliberate: a worker's failure is the batch's groups' reward failure
                dead = self.spec.actors and _actor_died(err)
                if dead:
                    self.workers[k] = self._start()
                    self.counts["rm_worker_restarts"] += 1
                    log.warning("reward model worker %d died (%s): replaced", k, type(err).__name__)
                if attempt == 1 or not dead:
                    self.counts[f"reward_error:{NAME}"] += 1
                    raise RewardFailure("error", NAME, f"{type(err).__name__}: {err}") from None
                self.counts["rm_retries"] += 1
        raise AssertionError("unreachable")

    def stats(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self.counts.items()}, "rm_seconds": self.seconds}

    def close(self) -> None:
        for task in self._loops:
            task.cancel()
        if self.spec.actors:
            import ray

            for actor in self.workers:
                ray.kill(actor)


def _actor_died(err: BaseException) -> bool:
    """A Ray actor that is gone (killed, crashed, its node lost)."""
    import ray.exceptions

    return isinstance(err, ray.exceptions.RayActorError | asyncio.TimeoutError)

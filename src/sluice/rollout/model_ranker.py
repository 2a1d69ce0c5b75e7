"""A learned output-length ranker (StreamRL §4's small-model ranker): a tiny causal sequence model
over the prompt's token ids with a regression head, trained on the run's own finished samples.

``SequenceLengthRanker`` is a ``LengthPredictor`` (``fleet.length_ranker: model``): token ids are
hashed into ``buckets`` embeddings, a one-layer GRU reads the prompt left to right (causal, like the
LM StreamRL fine-tunes, at a size that trains on a CPU between steps) and a linear head on its last
state predicts ``log(1 + length)``. It keeps the latest ``memory`` (prompt, length) pairs and, every
``train_every`` observations, takes ``steps`` Adam steps on random mini-batches of them, so it
follows the policy as lengths drift. Unlike the ridge ranker's bag of hashed tokens and pairs
(``length_ranker.py``), it can learn rules over where tokens sit in the prompt (the first token
against the last, a count of a pattern). Until it has trained once it predicts one constant
(no ranking). It never generates or routes anything.

A burst of training (about 0.75 s of CPU on this machine) runs on a thread of its own
(``background``, the default), not on the rollout worker's event loop, which observes and predicts
between requests: the burst trains a learner copy of the network and then swaps a copy of it in
for ``predict`` (one reference assignment), so predictions never see half-updated weights. A burst
due while the last still runs is skipped and counted (``skipped_bursts``; its samples are in the
next one's memory); a burst's error is raised by the next ``observe`` or ``wait``.
"""

from __future__ import annotations

import copy
import math
import random
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn


class _Net(nn.Module):
    def __init__(self, buckets: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(buckets + 1, hidden, padding_idx=0)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``ids`` [batch, seq] (0 pads the right), ``lengths`` [batch] -> [batch] log lengths."""
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(ids), lengths, batch_first=True, enforce_sorted=False)
        _, last = self.rnn(packed)
        out: torch.Tensor = self.head(last[-1]).squeeze(-1)
        return out


class SequenceLengthRanker:
    """See the module docstring; ``seed`` fixes its initial weights and mini-batch draws."""

    def __init__(
        self,
        buckets: int = 1024,
        hidden: int = 32,
        memory: int = 4096,
        train_every: int = 64,
        steps: int = 30,
        batch: int = 64,
        lr: float = 3e-3,
        max_prompt: int = 256,
        seed: int = 0,
        background: bool = True,
    ) -> None:
        if min(buckets, hidden, memory, train_every, steps, batch, max_prompt) < 1 or lr <= 0:
            raise ValueError("SequenceLengthRanker: every size must be >= 1 and lr > 0")
        generator = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng():
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
            self.net = _Net(buckets, hidden).eval()
        self._learner = copy.deepcopy(self.net)  # trained by the bursts; ``net`` serves ``predict``
        self.buckets, self.max_prompt = buckets, max_prompt
        self.train_every, self.steps, self.batch = train_every, steps, batch
        self.optimizer = torch.optim.Adam(self._learner.parameters(), lr=lr)
        self.pairs: deque[tuple[tuple[int, ...], float]] = deque(maxlen=memory)
        self.observed = 0
        self.trained_steps = 0
        self.skipped_bursts = 0
        self._rng = random.Random(seed)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="length-ranker") if background else None
        self._pending: Future[None] | None = None

    def _encode(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """[batch, seq] hashed ids (1..buckets, 0 pads) of each prompt's last ``max_prompt`` tokens."""
        rows = [list(p)[-self.max_prompt :] or [0] for p in prompts]
        ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
        for k, row in enumerate(rows):
            ids[k, : len(row)] = torch.tensor(row, dtype=torch.long) % self.buckets + 1
        return ids, torch.tensor([len(r) for r in rows])

    def observe(self, prompt_ids: Sequence[int], length: int) -> None:
        if length < 0:
            raise ValueError(f"a response length cannot be negative, got {length}")
        self.pairs.append((tuple(prompt_ids), math.log1p(length)))
        self.observed += 1
        if self.observed % self.train_every:
            return
        if self._executor is None:
            self._train(list(self.pairs))
            return
        if self._pending is not None:
            if not self._pending.done():
                self.skipped_bursts += 1
                return
            self._pending.result()  # a failed burst raises here
        self._pending = self._executor.submit(self._train, list(self.pairs))

    def wait(self) -> None:
        """Block until the running burst (if any) has swapped its network in."""
        if self._pending is not None:
            self._pending.result()

    def _train(self, pairs: list[tuple[tuple[int, ...], float]]) -> None:
        learner = self._learner
        learner.train()
        for _ in range(self.steps):
            chosen = self._rng.sample(pairs, min(self.batch, len(pairs)))
            ids, lengths = self._encode([p for p, _ in chosen])
            target = torch.tensor([y for _, y in chosen])
            loss = nn.functional.mse_loss(learner(ids, lengths), target)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        self.net = copy.deepcopy(learner).eval()  # one assignment: predict sees the old or the new net
        self.trained_steps += self.steps

    @torch.no_grad()
    def predict(self, prompts: Sequence[Sequence[int]]) -> list[float]:
        if not prompts:
            return []
        if not self.trained_steps:
            return [0.0] * len(prompts)
        ids, lengths = self._encode(prompts)
        return torch.expm1(self.net(ids, lengths)).tolist()

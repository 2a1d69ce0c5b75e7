"""The critic of PPO: the policy's architecture with a scalar value head, trained by clipped
value regression.

``ValueModel`` is the causal LM's decoder (its ``base_model``, without the LM head) plus a
``Linear(hidden, 1)`` initialised to zero, so every value starts at 0. The value of response
token ``t`` is read at the position that predicts it (the state before the token), the same
positions the trainer gathers log-probs at. ``CriticEngine.train_step`` minimises, per loss
token, ``½ · max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²)`` averaged over the step's
loss tokens (PPO's value clipping keeps the critic near the values the advantages were
computed with), in length-sorted padded chunks of at most ``token_budget`` positions (as the
actor's ``padded`` layout) with one AdamW step. ``values`` runs each prompt group on its own,
so a sample's values do not depend on which other groups share the call: the critic-values
queue task (``dag/node_worker.py``) sees rows as they arrive and must give the values a
whole-batch call gives. ``export_weights`` / ``load_weights`` carry the critic from the
trainer, which updates it, to that task's worker. ``distribute`` makes it one rank of the
trainer's ``ddp`` (a replica each, gradients all-reduced once per update) or ``fsdp2`` (sharded
like the policy; its forwards run in lockstep over the ranks, padded with idle ones).

Deliberately not here: returns and advantages (``trainer/algos/gae.py``, ``trainer/ppo.py``),
sharing the actor's trunk.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from sluice.api.types import Sample
from sluice.engines.hf_model import load_causal_lm, worker_device
from sluice.engines.padding import pad_batch
from sluice.engines.response_tokens import length_buckets
from sluice.engines.strategies import (
    GatheredWeights,
    full_tensor,
    load_shards,
    lockstep_count,
    save_shards,
    shard_fsdp2,
    wrap_ddp,
)

CRITIC_FILE = "critic.pt"
"""The critic's weights and optimizer state inside a checkpoint folder."""
CRITIC_SHARDS = "critic_dcp"
"""``fsdp2``: the critic's ``torch.distributed.checkpoint`` folder inside a checkpoint folder."""


class ValueModel(torch.nn.Module):
    """Decoder trunk + linear value head: ``[B, T]`` token ids → ``[B, T]`` values."""

    def __init__(self, model_dir: str | Path) -> None:
        super().__init__()
        self.trunk = load_causal_lm(model_dir).base_model
        self.head = torch.nn.Linear(self.trunk.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self._no_split_modules = self.trunk._no_split_modules  # the decoder layers fsdp2 shards

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1)


class CriticEngine:
    """Computes and fits per-response-token values (fp32, on the worker's device; one rank of
    ``ddp`` / ``fsdp2`` after ``distribute``)."""

    def __init__(
        self,
        model_dir: str | Path,
        lr: float,
        value_clip: float = 0.2,
        grad_clip: float = 1.0,
        token_budget: int = 2048,
        weight_bucket_bytes: int = 256 << 20,
    ) -> None:
        self.device = worker_device()
        self.model = ValueModel(model_dir).to(self.device)
        self.value_clip = value_clip
        self.grad_clip = grad_clip
        self.token_budget = token_budget
        self.weight_bucket_bytes = weight_bucket_bytes
        self._lr = lr
        self._build_optimizer()
        self.rank, self.world_size = 0, 1
        self.ddp: torch.nn.Module | None = None
        self.lockstep = False
        """``fsdp2``: every forward is a collective, run the same number of times on every rank."""

    def _build_optimizer(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self._lr, weight_decay=0.0)

    def distribute(self, strategy: str, *, cpu_offload: bool = False) -> None:
        """Become one rank of the default process group: ``ddp`` (a replica per rank, gradients
        all-reduced once per update) or ``fsdp2`` (sharded per decoder layer, float32, forwards
        in lockstep). Call before the first step."""
        if strategy == "single":
            return
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if strategy == "ddp":
            self.ddp = wrap_ddp(self.model, self.device)
        elif strategy == "fsdp2":
            shard_fsdp2(self.model, torch.float32, cpu_offload)
            self._build_optimizer()  # over the shards
            self.lockstep = True
        else:
            raise ValueError(f"unknown trainer strategy {strategy!r}")

    def values(self, samples: Sequence[Sample]) -> list[list[float]]:
        """``[samples][response tokens]``: the value of the state before each response token,
        computed group by group (the same numbers however the groups are batched together)."""
        out: list[list[float]] = [[] for _ in samples]
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.group_id, []).append(i)
        chunks = [
            [members[j] for j in part]
            for members in groups.values()
            for part in length_buckets([samples[i] for i in members], self.token_budget)
        ]
        idle = self._idle_count(len(chunks))
        self.model.eval()
        with torch.no_grad():
            for chunk in chunks:
                flat, lengths = self._forward([samples[i] for i in chunk])
                for i, row in zip(chunk, torch.split(flat.cpu(), lengths), strict=True):
                    out[i] = row.tolist()
            for _ in range(idle):
                self._idle_pass(backward=False)
        return out

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        """Detached copies of the value model's weights (trunk and head); under ``fsdp2`` full
        tensors gathered bucket by bucket as the mapping is read (every rank must read it)."""
        if self.lockstep:
            return GatheredWeights(self.model, self.weight_bucket_bytes)
        return {name: t.detach().clone() for name, t in self.model.state_dict().items()}

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy ``weights`` (``export_weights`` of another critic) into this one."""
        self.model.load_state_dict(dict(weights))

    def save(self, path: str | Path) -> None:
        """Weights and optimizer state into ``path/CRITIC_FILE``, written by rank 0; call it on every
        rank: under ``fsdp2`` each writes its shard under ``path/CRITIC_SHARDS``."""
        if self.lockstep:
            save_shards(self.model, self.optimizer, Path(path) / CRITIC_SHARDS)
            return
        if self.rank > 0:
            return
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        torch.save(state, Path(path) / CRITIC_FILE)

    def load(self, path: str | Path) -> None:
        if self.lockstep:
            load_shards(self.model, self.optimizer, Path(path) / CRITIC_SHARDS)
            return
        state = torch.load(Path(path) / CRITIC_FILE, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def train_step(
        self,
        samples: Sequence[Sample],
        returns: Sequence[Sequence[float]],
        old_values: Sequence[Sequence[float]],
        total_tokens: float | None = None,
    ) -> dict[str, float]:
        """One AdamW step on the clipped value loss over ``samples``' loss tokens; summed stats
        ``value_loss`` (the step's loss), ``value_clipped_tokens``, ``value_tokens``, ``value_grad_norm``.
        ``total_tokens``: the update's loss tokens over every rank (default: ``samples``')."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = float(max(total_tokens or sum(sum(s.loss_mask) for s in samples), 1))
        stats = {"value_loss": 0.0, "value_clipped_tokens": 0.0, "value_tokens": 0.0}
        chunks = length_buckets(samples, self.token_budget)
        idle = self._idle_count(len(chunks))
        for part in chunks:
            values, _ = self._forward([samples[i] for i in part])
            target = self._flat([returns[i] for i in part])
            old = self._flat([old_values[i] for i in part])
            mask = torch.tensor([m for i in part for m in samples[i].loss_mask], dtype=torch.bool, device=self.device)
            loss, clipped = clipped_value_loss(values, old, target, mask, self.value_clip)
            (loss / total).backward()
            stats["value_loss"] += float(loss.detach()) / total
            stats["value_clipped_tokens"] += clipped
            stats["value_tokens"] += float(mask.sum())
        for _ in range(idle + (self.ddp is not None)):
            self._idle_pass(backward=True)
        if self.world_size > 1:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.world_size)  # DDP and FSDP average over the ranks: the sum
        norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)))
        if math.isfinite(norm):
            self.optimizer.step()
        stats["value_grad_norm"] = norm
        return stats

    def _idle_count(self, mine: int) -> int:
        """``fsdp2``: the idle forwards that pad this rank's ``mine`` to the busiest rank's count
        (a collective: agreed before any forward runs, or the ranks' collectives would cross)."""
        return lockstep_count(mine, self.device) - mine if self.lockstep else 0

    def _idle_pass(self, backward: bool) -> None:
        """A one-token forward (and zero-loss backward): a collective's share, contributing nothing.
        Under ``ddp`` it goes through the wrapper, whose backward all-reduces what the chunks
        accumulated outside it."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        out = (self.ddp if self.ddp is not None else self.model)(ids, torch.ones_like(ids))
        if backward:
            (out.sum() * 0.0).backward()

    def _forward(self, samples: Sequence[Sample]) -> tuple[torch.Tensor, list[int]]:
        batch = {k: v.to(self.device) for k, v in pad_batch(samples).items()}
        values = self.model(batch["input_ids"], batch["attention_mask"])  # [B, T]
        return values[batch["logit_rows"], batch["logit_cols"]], batch["response_lengths"].tolist()

    def _flat(self, rows: Sequence[Sequence[float]]) -> torch.Tensor:
        return torch.tensor([x for row in rows for x in row], dtype=torch.float32, device=self.device)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, float]:
    """Σ over masked tokens of ``½ · max((V − R)², (V_old + clip(V − V_old, ±clip) − R)²)`` (all
    ``[tokens]``), and how many tokens the clipped branch decided."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    plain = (values - returns) ** 2
    bounded = (clipped_values - returns) ** 2
    per_token = 0.5 * torch.maximum(plain, bounded)
    zero = torch.zeros_like(per_token)
    return torch.where(mask, per_token, zero).sum(), float((mask & (bounded > plain)).sum())

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
trainer, which updates it, to that task's worker.

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
from sluice.engines.hf_model import load_causal_lm
from sluice.engines.padding import pad_batch
from sluice.engines.response_tokens import length_buckets
from sluice.engines.strategies import wrap_ddp

CRITIC_FILE = "critic.pt"
"""The critic's weights and optimizer state inside a checkpoint folder."""


class ValueModel(torch.nn.Module):
    """Decoder trunk + linear value head: ``[B, T]`` token ids → ``[B, T]`` values."""

    def __init__(self, model_dir: str | Path) -> None:
        super().__init__()
        self.trunk = load_causal_lm(model_dir).base_model
        self.head = torch.nn.Linear(self.trunk.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1)


class CriticEngine:
    """Computes and fits per-response-token values (fp32, one device)."""

    def __init__(
        self,
        model_dir: str | Path,
        lr: float,
        value_clip: float = 0.2,
        grad_clip: float = 1.0,
        token_budget: int = 2048,
    ) -> None:
        self.model = ValueModel(model_dir)
        self.value_clip = value_clip
        self.grad_clip = grad_clip
        self.token_budget = token_budget
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.world_size = 1
        self.ddp: torch.nn.Module | None = None

    def distribute(self, strategy: str) -> None:
        """Become one rank of the default process group: ``ddp`` (a replica per rank, gradients
        all-reduced once per update). ``fsdp2`` does not shard the critic yet."""
        if strategy == "fsdp2":
            raise ValueError("trainer.algorithm=ppo with trainer.strategy: fsdp2 is not supported yet; use ddp")
        if strategy == "ddp":
            self.world_size = dist.get_world_size()
            self.ddp = wrap_ddp(self.model, next(self.model.parameters()).device)

    def values(self, samples: Sequence[Sample]) -> list[list[float]]:
        """``[samples][response tokens]``: the value of the state before each response token,
        computed group by group (the same numbers however the groups are batched together)."""
        out: list[list[float]] = [[] for _ in samples]
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.group_id, []).append(i)
        self.model.eval()
        with torch.no_grad():
            for members in groups.values():
                for part in length_buckets([samples[i] for i in members], self.token_budget):
                    flat, lengths = self._forward([samples[members[j]] for j in part])
                    for j, row in zip(part, torch.split(flat, lengths), strict=True):
                        out[members[j]] = row.tolist()
        return out

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Detached copies of the value model's weights (trunk and head)."""
        return {name: t.detach().clone() for name, t in self.model.state_dict().items()}

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy ``weights`` (``export_weights`` of another critic) into this one."""
        self.model.load_state_dict(dict(weights))

    def save(self, path: str | Path) -> None:
        """Weights and optimizer state into ``path/CRITIC_FILE``."""
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        torch.save(state, Path(path) / CRITIC_FILE)

    def load(self, path: str | Path) -> None:
        state = torch.load(Path(path) / CRITIC_FILE, weights_only=True)
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
        for part in length_buckets(samples, self.token_budget):
            values, _ = self._forward([samples[i] for i in part])
            target = _flat([returns[i] for i in part])
            old = _flat([old_values[i] for i in part])
            mask = torch.tensor([m for i in part for m in samples[i].loss_mask], dtype=torch.bool)
            loss, clipped = clipped_value_loss(values, old, target, mask, self.value_clip)
            (loss / total).backward()
            stats["value_loss"] += float(loss.detach()) / total
            stats["value_clipped_tokens"] += clipped
            stats["value_tokens"] += float(mask.sum())
        if self.ddp is not None:  # one pass through the wrapper all-reduces what the chunks accumulated
            ids = torch.zeros((1, 1), dtype=torch.long, device=next(self.model.parameters()).device)
            (self.ddp(ids, torch.ones_like(ids)).sum() * 0.0).backward()
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.world_size)  # DDP averages: the sum over the ranks
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        if math.isfinite(float(norm)):
            self.optimizer.step()
        stats["value_grad_norm"] = float(norm)
        return stats

    def _forward(self, samples: Sequence[Sample]) -> tuple[torch.Tensor, list[int]]:
        batch = pad_batch(samples)
        values = self.model(batch["input_ids"], batch["attention_mask"])  # [B, T]
        return values[batch["logit_rows"], batch["logit_cols"]], batch["response_lengths"].tolist()


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


def _flat(rows: Sequence[Sequence[float]]) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row], dtype=torch.float32)

"""The reward-model step: the Bradley–Terry loss of preference pairs on a scalar model.

A pair is the token ids of its chosen and of its rejected response (``rewards/reward_model.py``'s
``rm_input_ids``). The loss of a step is ``mean over pairs of −log σ(r_chosen − r_rejected)``
(TRL's ``RewardTrainer``, InstructGPT's reward model), where ``r`` is the model's score of the
sequence (``engines/scalar_model.py``). A step's pairs are cut into chunks of at most
``token_budget`` padded positions (both sides of a pair in one forward), each forward and backward
through ``HFTrainEngine.accumulate_loss``, and one clipped AdamW step under the engine's strategy
(``single`` / ``ddp``), dtype and LR schedule. ``pair_metrics`` is the validation: pairwise
accuracy (chosen scored above rejected), loss and mean margin. Deliberately not here: rendering
pairs (``data/preferences.py``), the run's loop, logs and checkpoints (``controller/rm.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.response_tokens import buckets_of
from sluice.engines.scalar_model import forward, scores

Pair = tuple[Sequence[int], Sequence[int]]
"""(chosen ids, rejected ids)."""


def pair_chunks(pairs: Sequence[Pair], token_budget: int) -> list[list[int]]:
    """Pair indices in length-sorted chunks of at most ``token_budget`` padded positions (2 rows
    per pair, padded to the chunk's longest side)."""
    return buckets_of([2 * max(len(c), len(r)) for c, r in pairs], token_budget)


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """``[P]`` per-pair losses ``−log σ(r_c − r_r)``."""
    return -F.logsigmoid(chosen - rejected)


def pairwise_step(
    engine: HFTrainEngine, pairs: Sequence[Pair], token_budget: int, pad_id: int, normaliser: float | None = None
) -> dict[str, float]:
    """One optimizer step on ``pairs``; the engine's totals (``loss``: the mean pair loss,
    ``correct``: pairs scored the right way round before the update). ``normaliser``: the whole
    step's pairs when ``pairs`` is one rank's share of it."""
    engine.begin_step()
    for chunk in pair_chunks(pairs, token_budget):
        part = [pairs[i] for i in chunk]

        def loss_of(model: torch.nn.Module, part: list[Pair] = part) -> tuple[torch.Tensor, dict[str, float]]:
            r = forward(model, [c for c, _ in part] + [r for _, r in part], pad_id)  # [2P]
            chosen, rejected = r[: len(part)], r[len(part) :]
            with torch.no_grad():
                stats = {"correct": float((chosen > rejected).sum()), "margin": float((chosen - rejected).sum())}
            return bradley_terry(chosen, rejected).sum(), stats

        engine.accumulate_loss(loss_of)
    return engine.finish_step(grad_scale=1.0 / (normaliser if normaliser is not None else max(len(pairs), 1)))


def pair_sums(engine: HFTrainEngine, pairs: Sequence[Pair], token_budget: int, pad_id: int) -> dict[str, float]:
    """Sums over ``pairs`` under the current weights (no grad): ``pairs``, ``correct``, ``loss``, ``margin``."""
    if not pairs:
        return {"pairs": 0.0, "correct": 0.0, "loss": 0.0, "margin": 0.0}
    values = scores(engine.model, [c for c, _ in pairs] + [r for _, r in pairs], pad_id, token_budget)
    chosen, rejected = torch.tensor(values[: len(pairs)]), torch.tensor(values[len(pairs) :])
    return {
        "pairs": float(len(pairs)),
        "correct": float((chosen > rejected).sum()),
        "loss": float(bradley_terry(chosen, rejected).sum()),
        "margin": float((chosen - rejected).sum()),
    }


def pair_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``val_accuracy``, ``val_loss``, ``val_margin`` from ``pair_sums`` (summed over ranks)."""
    n = max(sums["pairs"], 1.0)
    return {"val_accuracy": sums["correct"] / n, "val_loss": sums["loss"] / n, "val_margin": sums["margin"] / n}

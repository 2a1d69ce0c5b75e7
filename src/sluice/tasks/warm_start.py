"""Supervised warm start (SFT) of a built-in task's tiny model on demonstrations drawn fresh every step.

The step is ``sluice sft``'s (``trainer/sft.py`` on the RL trainer's ``HFTrainEngine``: packed
rows, token-mean cross-entropy on the answer tokens and the closing ``<eos>``, one clipped AdamW
update, the LR warmup of ``LrSchedule``); only the source differs: instead of rows read from
files, each step draws ``batch_size`` (prompt, answer) demonstrations from the task's generator
(``tasks/base_model.py`` feeds it), untemplated, tokenised as ``data/conversations.plain_tokens``
tokenises a prompt / completion row. It does not evaluate, checkpoint or log; ``sluice sft`` does
for a user's own data.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from sluice.data.conversations import plain_tokens
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.lr_schedule import LrSchedule
from sluice.trainer.sft import as_sample, sft_step

Demonstration = Callable[[random.Random], tuple[str, str]]
WHOLE_BATCH = 1 << 30
"""One micro-batch per step: the engine still runs it in forwards of bounded positions."""


def sft_warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    demonstration: Demonstration,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    warmup_steps: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` in place for ``steps`` AdamW steps (linear LR warmup over ``warmup_steps``);
    returns the loss of every step."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    schedule = LrSchedule("constant", warmup_steps, steps) if warmup_steps else None
    engine = HFTrainEngine(model, lr=lr, betas=(0.9, 0.98), weight_decay=0.0, grad_clip=1.0, lr_schedule=schedule)
    losses = []
    for step in range(steps):
        pairs = [demonstration(rng) for _ in range(batch_size)]
        samples = [as_sample(*plain_tokens(tokenizer, prompt, answer), k) for k, (prompt, answer) in enumerate(pairs)]
        losses.append(sft_step(engine, samples, WHOLE_BATCH)["loss"])
        if on_step is not None:
            on_step(step + 1, losses[-1])
    model.eval()
    return losses

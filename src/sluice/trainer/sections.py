"""The trainer's pieces built from its own config section (``TrainerConfig``), in one place.

Workers take the ``trainer`` section (and the sampling temperature the log-probs are taken at)
and build what they need here: the algorithm, the update schedule, PPO's critic, the train
engine. Nothing else copies trainer fields by hand. It does not train or place anything.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from sluice.config import TrainerConfig
from sluice.engines.hf_model import load_causal_lm, on_device, slow_bf16_reason
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.lora import LoraSpec
from sluice.engines.lr_schedule import LrSchedule
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.ppo import CriticSpec
from sluice.trainer.updates import UpdateSchedule

logger = logging.getLogger(__name__)


def algorithm_of(t: TrainerConfig) -> GRPOAlgorithm:
    """The advantage estimator and the loss family of the section."""
    return GRPOAlgorithm(
        estimator="gae" if t.algorithm == "ppo" else t.algorithm,
        clip_low=t.clip_low,
        clip_high=t.clip_high,
        policy_loss=t.policy_loss,
        loss_agg_mode=t.loss_agg_mode,
        dual_clip_c=t.dual_clip_c,
        behav_weight_cap=t.tis_cap,
        tis_mode=t.tis_mode,
        tis_level=t.tis_level,
        kl_coef=t.kl_coef,
        kl_estimator=t.kl_estimator,
        kl_in=t.kl_in,
        entropy_coef=t.entropy_coef,
    )


def schedule_of(t: TrainerConfig) -> UpdateSchedule:
    """How a step's batch becomes optimizer updates (PPO mini-batches, epochs, proximal policy)."""
    return UpdateSchedule(t.ppo_mini_batches, t.ppo_epochs, t.prox_logprobs == "recompute")


def critic_of(t: TrainerConfig) -> CriticSpec | None:
    """PPO's critic (``algorithm: ppo``), else ``None``."""
    if t.algorithm != "ppo":
        return None
    bucket = t.weight_bucket_mb << 20
    return CriticSpec(t.critic_lr, t.value_clip, t.grad_clip, t.micro_batch_tokens, t.gae_gamma, t.gae_lambda, bucket)


def lr_schedule_of(t: TrainerConfig, steps: int) -> LrSchedule | None:
    """The learning-rate schedule over a run of ``steps`` steps, in optimizer updates (``None``:
    a constant ``lr`` from the first update)."""
    if t.lr_schedule == "constant" and t.lr_warmup_steps == 0:
        return None
    updates = schedule_of(t).updates
    return LrSchedule(t.lr_schedule, t.lr_warmup_steps * updates, max(steps, 1) * updates)


def engine_options(t: TrainerConfig, temperature: float, steps: int = 0) -> dict[str, Any]:
    """``HFTrainEngine``'s arguments besides the model (``steps``: the run's, for the LR schedule)."""
    return {
        "lr": t.lr,
        "betas": t.betas,
        "weight_decay": t.weight_decay,
        "grad_clip": t.grad_clip,
        "temperature": temperature,
        "layout": t.layout,
        "share_prompts": t.share_prompts,
        "pack_row_tokens": t.pack_row_tokens,
        "lora": LoraSpec(t.lora_rank, t.lora_alpha, t.lora_targets) if t.lora_rank else None,
        "lr_schedule": lr_schedule_of(t, steps),
        "dtype": getattr(torch, t.dtype),
        "activation_checkpointing": t.activation_checkpointing,
        "weight_bucket_bytes": t.weight_bucket_mb << 20,
    }


def train_engine(model_dir: str | Path, t: TrainerConfig, temperature: float, steps: int) -> HFTrainEngine:
    """The policy's train engine, loaded from ``model_dir``, its LR schedule over ``steps`` steps."""
    model = on_device(load_causal_lm(model_dir))
    slow = slow_bf16_reason(model.device) if t.dtype == "bfloat16" else None
    if slow:
        logger.warning("trainer.dtype=bfloat16 will be much slower than float32 here: %s", slow)
    return HFTrainEngine(model, **engine_options(t, temperature, steps))


def frozen_engine(model_dir: str | Path, t: TrainerConfig, temperature: float) -> HFTrainEngine:
    """The reference policy: the model at ``model_dir`` with gradients off (never stepped)."""
    frozen = {"lr": 0.0, "lora": None, "lr_schedule": None, "activation_checkpointing": False}
    options = {**engine_options(t, temperature), **frozen}
    engine = HFTrainEngine(on_device(load_causal_lm(model_dir)), **options)
    engine.model.requires_grad_(False)
    engine.model.eval()
    return engine

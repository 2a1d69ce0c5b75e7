"""The trainer's config section: algorithm, loss, optimizer, schedule, and how it is laid out on
devices (strategy, dtype, ranks). ``config/models.py`` assembles it into a run's config; this module
only declares and validates.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sluice.config.section import Section as _Section

GROUP_RELATIVE = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"})
"""Estimators whose baseline is the prompt group's other samples: with one sample a group every
advantage is zero (``grpo``, ``dr_grpo``, ``reinforce_pp_baseline``) or undefined (``rloo``).
``tests/unit/test_algos.py`` checks this set against ``trainer/algos``."""


class TrainerConfig(_Section):
    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"] = "grpo"
    """Advantage estimator: ``grpo`` (group mean and std), ``dr_grpo`` (group mean only), ``rloo``
    (leave-one-out group mean), ``reinforce_pp`` (REINFORCE++: rewards whitened over the global
    batch's loss tokens), ``reinforce_pp_baseline`` (group mean subtracted, then whitened),
    ``ppo`` (PPO with a critic: a value head on the policy's architecture, GAE advantages,
    clipped value regression; in ``run.mode: async`` the critic's values are a queue task of
    their own and the critic trains in the trainer's step; under ``strategy: ddp`` / ``fsdp2`` the
    critic is replicated / sharded over the ranks like the policy)."""

    gae_gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """``ppo``: GAE discount γ (1 for outcome rewards on finite responses)."""

    gae_lambda: float = Field(default=1.0, ge=0.0, le=1.0)
    """``ppo``: GAE λ; 1 gives Monte-Carlo returns minus the value baseline, lower trades
    variance for the critic's bias (verl / AReaL use 1; classic PPO 0.95)."""

    value_clip: float = Field(default=0.2, gt=0.0)
    """``ppo``: the critic's new values are clipped to ``V_old ± value_clip`` in the value loss."""

    critic_lr: float = Field(default=1e-4, gt=0.0)
    """``ppo``: AdamW learning rate of the critic (it starts from the policy's weights with a
    zero value head)."""

    policy_loss: Literal["ppo_clip", "cispo", "gspo", "topr"] = "ppo_clip"
    """Policy loss, each times the behaviour weight ``π_prox / π_behav``: ``ppo_clip`` (decoupled
    PPO), ``cispo`` (clipped IS weight, REINFORCE-style), ``gspo`` (sequence-level ratio, clipped),
    ``topr`` (no IS weight on positive advantages, ``clamp(ratio, 0, 1)`` on the others)."""

    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How per-token losses become the step's loss (verl's names): mean over the step's loss
    tokens, or mean over its sequences of each sequence's token sum / token mean."""

    dual_clip_c: float | None = Field(default=None, gt=1.0)
    """PPO dual clip: for negative advantages the loss is bounded by ``c · |A|`` (``ppo_clip``
    only; ``null`` disables; typical 3)."""

    tis_cap: float | None = Field(default=None, gt=0.0)
    """Truncated importance sampling: cap on the behaviour weight ``π_prox / π_behav``
    (``null``: untruncated)."""

    tis_mode: Literal["cap", "mask"] = "cap"
    """What ``tis_cap`` does to a weight above it: ``cap`` clamps it to the cap, ``mask`` drops
    the token (or sequence) from the loss (it still counts in the normaliser)."""

    tis_level: Literal["token", "sequence"] = "token"
    """Granularity of the behaviour weight: per token, or one per sequence
    (``exp(Σ_t (log π_prox − log π_behav))``)."""

    kl_coef: float = Field(default=0.0, ge=0.0)
    """β of the KL to the frozen reference policy (the initial model); 0 disables it and the
    reference step. Use 1e-3 to 1e-2 to keep a long run near the base model (verl: 1e-3); GRPO
    on verifiable rewards usually runs without it."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of KL(π_θ ‖ π_ref), with δ = log π_ref − log π_θ: ``k1`` = −δ,
    ``k2`` = δ²/2, ``k3`` = e^δ − 1 − δ (unbiased and ≥ 0: the usual choice for a loss term)."""

    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL enters: ``loss`` adds ``kl_coef ·`` the aggregated per-token KL (with
    gradient; GRPO-style), ``reward`` subtracts ``kl_coef · Σ_t KL_t`` (behaviour vs reference
    log-probs) from each sequence's reward before the advantages (RLHF-style; use ``k1``)."""

    entropy_coef: float = Field(default=0.0, ge=0.0)
    """Entropy bonus: subtracts ``entropy_coef ·`` the aggregated per-token entropy of π_θ from
    the loss (0 disables it). Small values (1e-3) slow the collapse of exploration."""

    lora_rank: int = Field(default=0, ge=0)
    """LoRA (needs ``pip install sluice[lora]``): train rank-``r`` adapters on ``lora_targets``
    instead of all weights; engines receive the merged weights. 0 trains every weight. Use it
    when the optimizer state of a full fine-tune does not fit; raise ``lr`` (≈ 10×) with it."""

    lora_alpha: float = Field(default=16.0, gt=0.0)
    """LoRA scale numerator: the adapter update is ``(lora_alpha / lora_rank) · B A``."""

    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Module names (suffixes) that get adapters; the default covers a Llama-style block."""

    lr: float = Field(default=1e-4, gt=0.0)
    """Adam learning rate (the peak, with a schedule)."""

    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After the warmup: keep ``lr``, or decay it linearly / by a cosine to 0 at ``run.steps``."""

    lr_warmup_steps: int = Field(default=0, ge=0)
    """Steps over which the learning rate rises linearly from 0 to ``lr`` (0: none)."""

    betas: tuple[float, float] = (0.9, 0.99)
    """Adam betas."""

    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""

    grad_clip: float = Field(default=1.0, gt=0.0)
    """Global gradient-norm clip."""

    clip_low: float = Field(default=0.2, ge=0.0)
    """Ratio clip below 1 (``1 - clip_low``) of the PPO and GSPO ratio. CISPO's IS weight has no
    lower bound (MiniMax-M1), so CISPO ignores it."""

    clip_high: float = Field(default=0.2, ge=0.0)
    """Ratio clip above 1 (``1 + clip_high``; raise it for DAPO clip-higher)."""

    ppo_mini_batches: int = Field(default=1, ge=1)
    """Optimizer updates per pass over a step's global batch: the batch is cut in arrival order
    into this many nearly equal parts, each one AdamW update with its own normaliser; the policy
    version still advances once per step. 1 (the default) lets the trainer accumulate while the
    step's groups arrive; more updates wait for the whole batch. Use 2-8 (AReaL uses 4) for more
    progress per generated sample, ideally with ``prox_logprobs: recompute``."""

    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over a step's global batch (each pass takes ``ppo_mini_batches`` updates). More
    than 1 reuses samples further off-policy; keep the clip on (``ppo_clip``, ``gspo``)."""

    prox_logprobs: Literal["behav", "recompute"] = "behav"
    """The proximal policy of the loss: ``behav`` uses the engine's sampling log-probs (standard
    PPO); ``recompute`` recomputes log-probs with the trainer's weights at the start of the step,
    once the step's global batch has arrived (decoupled PPO, AReaL eq. 5: the clip is a trust
    region around the step's start, the behaviour weight corrects for staleness). Use
    ``recompute`` with ``rollout.max_staleness`` ≥ 1 or ``ppo_mini_batches`` > 1; it costs one
    extra forward pass per sample. With one update per step the clip never binds (the proximal
    policy is the one updated): give it ``ppo_mini_batches`` ≥ 2. The staleness study
    (docs/algorithms.md, "Staleness: which loss for which η") found ``behav`` as good or better
    at every η on the default task, and no gain from a ``tis_cap``."""

    micro_batch_tokens: int = Field(default=2048, ge=1)
    """Token budget (prompt + response) of one micro-batch; gradients accumulate across them
    with step-wide normalisation, so this changes memory and speed, never the result. Smaller
    micro-batches let the streaming trainer start earlier in a step."""

    strategy: Literal["single", "ddp", "fsdp2"] = "single"
    """How the ranks hold the model (``docs/hardware.md``): ``single`` (one process, no group),
    ``ddp`` (torch DDP: a full replica per rank, gradients all-reduced), ``fsdp2`` (torch
    ``fully_shard`` per decoder layer: parameters, gradients and optimizer state sharded over the
    ranks, gathered layer by layer for each forward). ``fsdp2`` runs a step's forwards in lockstep
    over the ranks, so its trainer waits for the step's whole batch instead of streaming."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the trainer's forwards and backwards. Master weights and optimizer state
    stay float32 (``bfloat16``: autocast with ``single`` / ``ddp``, ``MixedPrecisionPolicy`` with
    float32 gradient reduction under ``fsdp2``). bf16 is the norm on GPUs; CPUs with AMX run its
    matmuls several times faster."""

    cpu_offload: bool = False
    """``fsdp2``: keep the sharded parameters, gradients and optimizer state in CPU memory and copy
    each layer to the device for its forward and backward (fits larger models, slower)."""

    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of storing them
    (less memory for long sequences, about one more forward of compute)."""

    weight_bucket_mb: int = Field(default=256, ge=1)
    """Weights for the engines are gathered and published in buckets of about this many MiB, so no
    rank holds more than one bucket of full tensors beyond its own shard (``fsdp2``)."""

    @model_validator(mode="after")
    def _strategy_fits_ranks(self) -> TrainerConfig:
        if self.cpu_offload and self.strategy != "fsdp2":
            raise ValueError("trainer.cpu_offload needs trainer.strategy: fsdp2")
        return self

    layout: Literal["packed", "padded"] = "packed"
    """Tensor layout of training forwards: ``packed`` (padding-free rows; with
    ``share_prompts`` a group's prompt is computed once for all its responses) or ``padded`` (one
    right-padded row per sample, length-sorted). Same result to float rounding; ``packed`` is
    about 2× faster on the default task (``benchmarks/training.py``)."""

    share_prompts: bool = True
    """``packed`` layout: lay a group out as its prompt followed by every response, each response
    attending to the prompt and itself only, so the prompt's forward and backward run once per
    group instead of once per sample. Turn off to measure plain packing."""

    pack_row_tokens: int = Field(default=0, ge=0)
    """``packed`` layout: rows hold whole groups, first-fit, up to this many positions or the
    longest group's length if that is more (0: the longest group's). Longer rows mean fewer rows
    but attention over a row is dense (O(row²)) on CPU; raise it on platforms with varlen
    attention kernels."""


def check_group_size(trainer: TrainerConfig, group_size: int) -> None:
    """``rollout.group_size: 1`` trains nothing under a group-relative estimator: refused, naming
    both keys (``reinforce_pp`` and ``ppo`` have baselines of their own and take it)."""
    if group_size == 1 and trainer.algorithm in GROUP_RELATIVE:
        raise ValueError(
            f"rollout.group_size: 1 with trainer.algorithm: {trainer.algorithm} (group-relative: every advantage "
            "would be zero or undefined); use rollout.group_size >= 2, or trainer.algorithm reinforce_pp or ppo"
        )

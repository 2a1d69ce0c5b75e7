"""The configuration of a sluice run: pydantic v2 models, the one source of config truth.

Every field carries a docstring (``use_attribute_docstrings``), which ``sluice train --help-config``
and ``docs/config.md`` render. Unknown keys are errors (``extra="forbid"``). Loading YAML files
and dotted overrides lives in ``config/loading.py``; the sections of services the rollout talks to
(inference engines, the reward service) live in ``config/services.py``. This module only
declares and validates.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from sluice.config.agentic import AgenticConfig
from sluice.config.fleet import FleetConfig, check_fleet
from sluice.config.section import Section as _Section
from sluice.config.services import RewardConfig, SGLangConfig, VLLMConfig


class ModelConfig(_Section):
    path: str | None = None
    """Local Hugging Face model folder (config.json, weights, tokenizer.json). ``null`` uses the
    embedded default: the task's tiny Llama, SFT-warm-started once and cached under ``cache_dir``."""

    cache_dir: str = ".cache/sluice"
    """Where the embedded default base model is built and cached (relative to the working dir)."""


class TaskConfig(_Section):
    name: str = "reverse_digits"
    """Built-in task (see ``sluice.tasks.TASKS``): its dataset generator, reward and evaluator."""

    train_prompts: int = Field(default=20000, ge=1)
    """How many RL training prompts the task generates (disjoint from the held-out set)."""

    eval_prompts: int = Field(default=500, ge=1)
    """Size of the fixed held-out set used by ``accuracy BASE -> FINAL`` and ``sluice eval``."""

    data_path: str | None = None
    """Optional JSONL file of training rows (``{"prompt": ..., <reward fields>}``) replacing the
    generated prompts."""


class RolloutConfig(_Section):
    group_size: int = Field(default=8, ge=1)
    """Samples per prompt (the GRPO group, ``n``)."""

    prompts_per_step: int = Field(default=32, ge=1)
    """Prompt groups per training step (the global batch ``B``)."""

    max_new_tokens: int | None = Field(default=None, ge=1)
    """Hard cap on response length in tokens (``null``: the task's own cap)."""

    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature of training rollouts (evaluation is always greedy)."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold of training rollouts."""

    max_batch: int = Field(default=512, ge=1)
    """Engine slots: sequences decoded together; a finished one frees its slot for a waiting one."""

    max_staleness: int = Field(default=1, ge=0)
    """η, the staleness bound of ``run.mode: async``: no trained sample is more than η policy
    versions older than the policy being trained. 0 reproduces ``sync`` exactly; 1 is AsyncFlow's
    one-step delayed update."""

    weight_update: Literal["interrupt", "defer", "staggered"] = "interrupt"
    """How engines take new weights: ``interrupt`` (load at once, re-prefill running sequences),
    ``defer`` (finish running sequences on the old weights, then swap; drain time is counted),
    ``staggered`` (replicas one at a time; a single engine behaves like ``defer``)."""

    engine: Literal["hf", "vllm", "sglang"] = "hf"
    """Inference engine of the rollout worker: ``hf`` (built-in torch continuous batching, no extra
    install), ``vllm`` (vLLM's AsyncLLM in the worker; options in ``vllm.*``; on CPU it needs
    ``make vllm-venv``) or ``sglang`` (a running SGLang server, ``sglang.*``). ``vllm`` and
    ``sglang`` need ``run.mode: async`` (docs/engines.md)."""

    filter_groups: Literal["none", "zero_signal"] = "none"
    """Dynamic filtering: ``zero_signal`` discards groups whose rewards are all equal (no GRPO
    signal) and returns their admission credit; discards are counted per reason."""

    scheduling: Literal["queue", "batch"] = "queue"
    """``queue``: every prompt group is an independent task; each sample is scored as soon as it
    finishes and each group is filtered and stored the moment it is scored (ROLL Flash queue
    scheduling). ``batch``: the classic barrier (the whole admission wave generates, then is
    scored, then filtered), kept for comparison. ``run.mode: async`` only."""

    redundant_groups: int = Field(default=0, ge=0)
    """Extra prompt groups kept generating beyond the admission bound (ROLL Flash's redundant
    prompts; 16 there): filtered groups are replaced without waiting, and once the step's quota of
    accepted groups is met the surplus still generating is aborted, counted
    (``discarded_redundant``) and its credit returned. Pays off with ``filter_groups:
    zero_signal`` and long-tailed lengths. ``run.mode: async`` only."""

    replicas: int = Field(default=1, ge=1)
    """Inference engine replicas behind the rollout worker's LLMProxy (least-outstanding-tokens
    routing). They live in the rollout worker's process and share its ``run.rollout_threads``, so
    adding replicas never oversubscribes the cores (on CPU it adds no speed; on accelerators each
    replica would own a device). ``run.mode: async`` only."""

    prompt_replication: bool = True
    """Route each of a prompt's samples on its own, so a hard prompt's long samples spread over
    the replicas (ROLL Flash prompt replication); off keeps a group on one replica (prefix
    sharing). Matters only with ``replicas > 1``; turn it off for long prompts and short answers."""

    stagger: int = Field(default=1, ge=1)
    """``weight_update: staggered``: how many replicas swap weights at a time while the others keep
    generating."""


class TrainerConfig(_Section):
    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"] = "grpo"
    """Advantage estimator: ``grpo`` (group mean and std), ``dr_grpo`` (group mean only), ``rloo``
    (leave-one-out group mean), ``reinforce_pp`` (REINFORCE++: rewards whitened over the global
    batch's loss tokens), ``reinforce_pp_baseline`` (group mean subtracted, then whitened),
    ``ppo`` (PPO with a critic: a value head on the policy's architecture, GAE advantages,
    clipped value regression; ``run.mode: sync`` only)."""

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
    """Adam learning rate."""

    betas: tuple[float, float] = (0.9, 0.99)
    """Adam betas."""

    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""

    grad_clip: float = Field(default=1.0, gt=0.0)
    """Global gradient-norm clip."""

    clip_low: float = Field(default=0.2, ge=0.0)
    """Ratio clip below 1 (``1 - clip_low``): PPO and GSPO ratio, CISPO's IS weight."""

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
    extra forward pass per sample."""

    micro_batch_tokens: int = Field(default=2048, ge=1)
    """Token budget (prompt + response) of one micro-batch; gradients accumulate across them
    with step-wide normalisation, so this changes memory and speed, never the result. Smaller
    micro-batches let the streaming trainer start earlier in a step."""

    data_parallel: int = Field(default=1, ge=1)
    """Trainer processes (data-parallel ranks, ``torch.distributed``: gloo on CPU, NCCL on GPU).
    Each trains its share of a step's groups, dealt by tokens; gradients are summed once per
    step, so the update equals one process's up to float rounding. Needs ``run.mode: async`` with
    ``run.backend: ray``, ``ppo_mini_batches`` = ``ppo_epochs`` = 1 and ``prox_logprobs: behav``.
    Each rank takes ``run.trainer_threads`` threads."""

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


class RunConfig(_Section):
    name: str = "default"
    """Run name: outputs go to ``<output_dir>/<name>/``."""

    output_dir: str = "runs"
    """Parent folder of run directories."""

    mode: Literal["sync", "async"] = "async"
    """``sync``: generate the whole batch, score, train, sync weights, one after another.
    ``async``: rollout, scoring and training run concurrently and stream through the
    TransferQueue under the staleness bound ``rollout.max_staleness``."""

    backend: Literal["local", "ray"] = "ray"
    """Where ``async`` workers run: ``ray`` (one actor per role, the production placement) or
    ``local`` (one process; for debugging)."""

    dag: str | None = None
    """The algorithm's data flow as a DAG file (docs/dag.md): a built-in name (``grpo``, ``grpo_kl``,
    ``ppo``, ``ppo_kl``) or a YAML path. ``null``: the built-in DAG of ``trainer.algorithm`` (with
    ``_kl`` when ``trainer.kl_coef > 0``). Custom nodes (extra rewards, filters) need ``run.mode: sync``."""

    ray_address: str | None = None
    """Ray cluster to join (``ray start --head`` prints it); ``null`` starts a local instance."""

    rollout_threads: int = Field(default=1, ge=1)
    """torch threads of the rollout worker (decoding tiny models is overhead-bound: 1 is best)."""

    trainer_threads: int = Field(default=1, ge=1)
    """torch threads of the trainer worker. Threads summed over workers should not exceed the
    cores; above that, workers use OpenMP's passive wait so they yield cores to each other."""

    trace: bool = True
    """Record a timeline of every worker's spans to ``trace.json`` in the run directory
    (view in Perfetto, or ``sluice trace RUN_DIR`` for a PNG Gantt chart)."""

    steps: int = Field(default=60, ge=0)
    """Training steps (policy versions) to run."""

    max_minutes: float | None = Field(default=None, gt=0.0)
    """Stop after this many minutes of training even if ``steps`` is not reached."""

    seed: int = 0
    """Seeds prompt order, sampling and model init; the same seed reproduces a run exactly."""

    eval_every: int = Field(default=20, ge=0)
    """Evaluate on the held-out set every this many steps (0: only before and after)."""

    threads: int = Field(default=0, ge=0)
    """torch threads for this process (0: all cores). Threads summed over processes must not
    exceed the cores."""

    progress: bool = True
    """Show a progress bar (disable for logs / CI)."""

    checkpoint_every: int = Field(default=0, ge=0)
    """Write a checkpoint every this many steps into ``<run dir>/checkpoints/`` (0: never). A
    checkpoint holds everything a lossless resume needs (docs/checkpoint.md); use it for runs
    that may be interrupted."""

    keep_checkpoints: int = Field(default=2, ge=1)
    """How many of the newest complete checkpoints to keep; older ones are deleted."""

    resume: str | None = None
    """``auto``: continue this run dir from its newest complete checkpoint (start fresh if there is
    none); a path: continue from that checkpoint folder; ``null``: start fresh. ``sluice train
    resume=auto`` is short for ``run.resume=auto``."""


class SluiceConfig(_Section):
    """A whole run."""

    @model_validator(mode="after")
    def _async_only_rollout_options(self) -> SluiceConfig:
        r = self.rollout
        used = {
            "replicas": r.replicas != 1,
            "redundant_groups": r.redundant_groups != 0,
            "scheduling": r.scheduling != "queue",
        }
        if self.run.mode == "sync" and any(used.values()):
            names = ", ".join(f"rollout.{name}" for name, on in used.items() if on)
            raise ValueError(f"{names}: needs run.mode=async (the sync loop has one engine and no admission)")
        return self

    model: ModelConfig = ModelConfig()
    """The policy to train."""

    task: TaskConfig = TaskConfig()
    """The task: prompts, reward, held-out set."""

    rollout: RolloutConfig = RolloutConfig()
    """Generation."""

    trainer: TrainerConfig = TrainerConfig()
    """Optimisation."""

    reward: RewardConfig = RewardConfig()
    """Reward function and the reward service that runs it."""

    run: RunConfig = RunConfig()
    """Run control and outputs."""

    vllm: VLLMConfig = VLLMConfig()
    """vLLM engine options (used when ``rollout.engine: vllm``)."""

    sglang: SGLangConfig = SGLangConfig()
    """SGLang engine options (used when ``rollout.engine: sglang``)."""

    fleet: FleetConfig = FleetConfig()
    """How the rollout's replicas receive weights (config/fleet.py)."""

    @model_validator(mode="after")
    def _fleet_placement(self) -> SluiceConfig:
        check_fleet(self.fleet, self.run.mode, self.run.backend)
        return self

    agentic: AgenticConfig = AgenticConfig()
    """Multi-turn environments (agentic RL): env, EnvRunner mode, redundancy, timeouts."""

    @model_validator(mode="after")
    def _data_parallel_placement(self) -> SluiceConfig:
        t = self.trainer
        if t.data_parallel > 1:
            if self.run.mode != "async" or self.run.backend != "ray":
                raise ValueError("trainer.data_parallel > 1 needs run.mode: async and run.backend: ray")
            if t.ppo_mini_batches != 1 or t.ppo_epochs != 1 or t.prox_logprobs != "behav":
                raise ValueError(
                    "trainer.data_parallel > 1 needs trainer.ppo_mini_batches = ppo_epochs = 1 and prox_logprobs: behav"
                )
        return self

    @model_validator(mode="after")
    def _engine_needs_async(self) -> SluiceConfig:
        if self.rollout.engine != "hf" and self.run.mode != "async":
            raise ValueError(
                f"rollout.engine: {self.rollout.engine!r} runs only with run.mode: async "
                "(the sync loop drives the built-in engine)"
            )
        return self

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments for the chosen ``rollout.engine`` (``engines.build_inference_engine``)."""
        if self.rollout.engine == "vllm":
            return self.vllm.model_dump()
        if self.rollout.engine == "sglang":
            return self.sglang.model_dump()
        return {}

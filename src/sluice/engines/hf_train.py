"""``TrainEngine`` for a Hugging Face causal LM trained in PyTorch (one rank of ``single`` / ``ddp`` / ``fsdp2``).

Role: the reference training engine. ``logprobs`` recomputes response-token log-probs without
grad; ``begin_step``, ``accumulate`` per micro-batch and ``finish_step`` sum an update's gradients,
scale them by its normaliser (the full-batch gradient), clip and take one AdamW step under an
optional ``LrSchedule`` (``transformers.get_scheduler``, checkpointed beside the optimizer).
Forwards run ``packed`` (``engines/packing.py``: padding-free rows in which a group's responses
share one copy of its prompt; ≈ 2× faster, ``benchmarks/training.py``) or ``padded`` (length-sorted,
right-padded chunks), with the same log-probs to float rounding. ``dtype`` is the compute dtype
(bf16: autocast over float32 master weights; under ``fsdp2`` its mixed-precision policy);
``distribute`` joins the ranks of the default process group as ``ddp`` or ``fsdp2``
(``engines/strategies.py``), under which every forward is a collective, so ``finish_step`` and
``logprobs`` run the ranks' forwards in lockstep. Log-probs use ``log_softmax(logits / T)`` (in
float32), the engines' ``Completion.logprobs`` convention (``T <= 0``: raw logits).

Deliberately not here: tensor or pipeline parallelism, and deciding micro-batch boundaries (the
caller passes ``MicroBatch`` es from ``trainer/step.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from sluice.api.protocols import Algorithm
from sluice.api.types import LossInputs, MicroBatch, Sample
from sluice.engines.lora import LoraMerge, LoraSpec, apply_lora, load_adapters, merged_weights, save_merged
from sluice.engines.lr_schedule import LrSchedule
from sluice.engines.packing import pack_batch, packed_chunks
from sluice.engines.padding import pad_batch
from sluice.engines.response_tokens import flatten_rows, length_buckets, logprob_gap, reference_logp, token_entropy
from sluice.engines.strategies import (
    SCHEDULER_FILE,
    GatheredWeights,
    full_state_dict,
    full_tensor,
    load_sharded,
    lockstep_count,
    save_sharded,
    shard_fsdp2,
    wrap_ddp,
)

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"


class HFTrainEngine:
    """Trains ``model`` with AdamW; implements ``sluice.api.protocols.TrainEngine``.

    Args:
        model: an HF causal LM (fp32 expected), already on its device.
        lr, betas, weight_decay: AdamW hyper-parameters.
        grad_clip: max global gradient norm; ``None`` or ``<= 0`` disables clipping (the
            norm is still reported).
        temperature: sampling temperature the training log-probs are computed under.
        forward_token_budget: positions (rows × longest row) per forward pass in ``logprobs``.
        padded_token_budget: positions (rows × longest row) per forward in training.
        layout: ``packed`` (shared-prompt packed rows) or ``padded`` (one right-padded row per
            sample).
        share_prompts: in the packed layout, compute a group's prompt once for all its responses.
        pack_row_tokens: in the packed layout, rows of whole groups up to this many positions or
            the longest group's length (dense attention makes long rows O(row²) on CPU).
        lora: train LoRA adapters only (``engines/lora.py``); weights are exported merged.
        lr_schedule: the learning rate over the run's optimizer updates (``None``: constant).
        dtype: compute dtype of forwards and backwards (master weights stay as loaded).
        activation_checkpointing: recompute each layer's activations in the backward.
        weight_bucket_bytes: ``fsdp2``: full tensors gathered per bucket of weight publication.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        temperature: float = 1.0,
        forward_token_budget: int = 16384,
        padded_token_budget: int = 2048,
        layout: str = "packed",
        share_prompts: bool = True,
        pack_row_tokens: int = 0,
        lora: LoraSpec | None = None,
        lr_schedule: LrSchedule | None = None,
        dtype: torch.dtype = torch.float32,
        activation_checkpointing: bool = False,
        weight_bucket_bytes: int = 256 << 20,
    ) -> None:
        if layout not in ("packed", "padded"):
            raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
        self.lora = lora
        self.model = model if lora is None else apply_lora(model, lora)  # then only adapters train
        self.grad_clip = grad_clip
        self.temperature = temperature
        self.forward_token_budget = forward_token_budget
        self.padded_token_budget = padded_token_budget
        self.layout = layout
        self.share_prompts = share_prompts
        self.pack_row_tokens = pack_row_tokens
        self.device = next(self.model.parameters()).device
        self.compute_dtype = dtype
        self.weight_bucket_bytes = weight_bucket_bytes
        if activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.strategy = "single"
        self.world_size = 1
        self.rank = 0
        self.ddp: torch.nn.Module | None = None
        """``ddp``: the wrapper the synchronising pass goes through (micro-batches bypass it)."""
        self._pending: list[tuple[MicroBatch, Algorithm]] = []
        self._optimizer_args = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        self._lr_schedule = lr_schedule
        self._build_optimizer()

    @property
    def _foreach(self) -> bool | None:
        """AdamW and the gradient clip over all parameters at once on CPU, where torch's default is
        one parameter at a time: the same operations in the same order, so the same bits, in a
        tenth of the dispatches (docs/performance.md); elsewhere torch's own default."""
        return True if self.device.type == "cpu" else None

    def _build_optimizer(self) -> None:
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        args = {**self._optimizer_args, "foreach": self._foreach}
        self.optimizer = torch.optim.AdamW(self._params, **args)  # type: ignore[arg-type]
        self.scheduler = self._lr_schedule.build(self.optimizer) if self._lr_schedule is not None else None

    def distribute(self, strategy: str, *, cpu_offload: bool = False) -> None:
        """Become one rank of the default process group (already initialised) under ``strategy``:
        ``ddp`` wraps the model, ``fsdp2`` shards it in place and rebuilds the optimizer over the
        shards. Call before the first step."""
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.strategy = strategy
        if strategy == "ddp":
            self.ddp = wrap_ddp(self.model, self.device)
        elif strategy == "fsdp2":
            shard_fsdp2(self.model, self.compute_dtype, cpu_offload)
            self._build_optimizer()
        elif strategy != "single":
            raise ValueError(f"unknown trainer strategy {strategy!r}")

    @property
    def lockstep(self) -> bool:
        """Forwards are collectives (``fsdp2``): every rank runs the same number of them."""
        return self.strategy == "fsdp2"

    def logprobs(self, samples: Sequence[Sample], temperature: float) -> list[list[float]]:
        """Per-response-token log-probs of each sample under the current weights (no grad)."""
        result: list[list[float]] = [[] for _ in samples]
        self.model.eval()
        plan = self.plan_forwards(samples, self.forward_token_budget)
        idle = lockstep_count(len(plan), self.device) - len(plan) if self.lockstep else 0  # agreed first
        with torch.no_grad(), self._autocast():
            for rows in plan:
                batch = self._to_device(self.forward_inputs([[samples[i] for i in row] for row in rows]))
                flat = self._response_logprobs(batch, temperature)[0].cpu()
                lengths = batch["response_lengths"].tolist()
                indices = [i for row in rows for i in row]
                for i, part in zip(indices, torch.split(flat, lengths), strict=True):
                    result[i] = part.tolist()
            for _ in range(idle):
                self._idle_pass(backward=False)
        return result

    def begin_step(self) -> None:
        """Start a streamed step: clear gradients and the step's metric sums."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self._totals: dict[str, float] = defaultdict(float)
        self._pending = []

    def accumulate(self, mb: MicroBatch, algorithm: Algorithm) -> None:
        """Forward + backward one micro-batch as soon as it is ready (gradients add up).

        Inside the micro-batch, rows are sorted by length and run in chunks of at most
        ``padded_token_budget`` positions, so a long-tailed batch is not padded to its longest
        row. The chunking depends only on the micro-batch, so it is deterministic. Under
        ``fsdp2`` the micro-batch waits for ``finish_step`` (the ranks' forwards run in lockstep).
        """
        if self.lockstep:
            self._pending.append((mb, algorithm))
            return
        self._backward(mb, algorithm)

    def _backward(self, mb: MicroBatch, algorithm: Algorithm) -> None:
        """Forward + backward every chunk of ``mb``."""
        first = not self._totals["micro_batches"]
        plan = self.plan_forwards(mb.samples, self.padded_token_budget)
        for rows in plan:
            with self._autocast():
                inputs = self._loss_inputs(mb, rows, algorithm.uses_entropy)
                if first:  # the train-inference log-prob gap, before this update changes the weights
                    self._totals.update(logprob_gap(inputs))
                    first = False
                out = algorithm.loss(inputs)
            out.loss.backward()
            self._totals["loss"] += float(out.loss.detach())
            for key, value in out.stats.items():
                self._totals[key] += value
            if "entropy_sum" not in out.stats and inputs.entropy is not None:  # logged without an entropy term
                self._totals["entropy_sum"] += float(inputs.entropy[inputs.mask.bool()].sum())
        self._totals["micro_batches"] += 1.0
        self._totals["samples"] += float(len(mb.samples))

    def accumulate_loss(self, loss_of: Callable[[torch.nn.Module], tuple[torch.Tensor, dict[str, float]]]) -> None:
        """Forward + backward a caller's own loss of the model (a head other than the LM's, e.g.
        ``sluice rm``'s pairwise loss of a scalar reward model): ``loss_of(model)`` returns the loss
        and stats that add to the step's totals. Not under ``fsdp2`` (its forwards are collectives
        the caller would have to run in lockstep)."""
        if self.lockstep:
            raise ValueError("accumulate_loss: not under fsdp2 (use single or ddp)")
        with self._autocast():
            loss, stats = loss_of(self.model)
        loss.backward()
        self._totals["loss"] += float(loss.detach())
        for key, value in stats.items():
            self._totals[key] += value
        self._totals["micro_batches"] += 1.0

    def _synchronise(self) -> None:
        """Sum the update's gradients over the ranks: ``fsdp2`` runs the held micro-batches with
        idle forwards up to the busiest rank's count (each backward reduce-scatters); ``ddp`` runs
        one idle pass through the DDP wrapper, whose backward all-reduces the gradients the
        micro-batches accumulated outside it (their forwards, never collectives, bypass it: DDP's
        own forward may rebuild its buckets, a collective, and ranks run different numbers)."""
        if self.lockstep:
            pending, self._pending = self._pending, []
            forwards = sum(len(self.plan_forwards(mb.samples, self.padded_token_budget)) for mb, _ in pending)
            idle = lockstep_count(forwards, self.device) - forwards  # agreed before any forward
            for mb, algorithm in pending:
                self._backward(mb, algorithm)
            for _ in range(idle):
                self._idle_pass(backward=True)
        elif self.strategy == "ddp":
            self._idle_pass(backward=True)

    def _idle_pass(self, backward: bool) -> None:
        """A one-token forward (and zero-loss backward): a collective's share, contributing nothing."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with self._autocast():
            module = self.ddp if self.ddp is not None else self.model
            logits = module(input_ids=ids, use_cache=False).logits
        if backward:
            (logits.float().sum() * 0.0).backward()

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        """bf16 autocast of a forward (not under ``fsdp2``, whose policy casts the parameters)."""
        if self.compute_dtype == torch.float32 or self.lockstep:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def finish_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        """Scale the accumulated gradients (``1 / normaliser`` when micro-batches were summed
        with normaliser 1 because the step's size was not known yet), clip, AdamW step."""
        self._synchronise()
        totals = self._totals
        gradient_scale = grad_scale * self.world_size  # DDP and FSDP average over the ranks: sum
        if gradient_scale != 1.0:
            for p in self._params:
                if p.grad is not None:
                    p.grad.mul_(gradient_scale)
        totals["loss"] *= grad_scale
        max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else math.inf
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(self._params, max_norm, foreach=self._foreach)))
        skipped = not math.isfinite(grad_norm)
        if skipped:
            logger.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm)
        else:
            self.optimizer.step()
        totals["lr"] = float(self.optimizer.param_groups[0]["lr"])  # this update's rate, scheduled or not
        if self.scheduler is not None:  # a skipped update still moves along the schedule
            self.scheduler.step()
        totals["skipped_steps"] = float(skipped)
        totals["grad_norm"] = grad_norm
        return dict(totals)

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        """Detached copies of the state dict; tied tensors stay shared in the copy. With LoRA, the
        plain model's weights with the adapters merged in. Under ``fsdp2``, full tensors gathered
        bucket by bucket as the mapping is read (``GatheredWeights``: every rank must read it)."""
        if self.lockstep:
            merge = LoraMerge.of(self.model) if self.lora is not None else None
            return GatheredWeights(self.model, self.weight_bucket_bytes, merge)
        if self.lora is not None:
            return merged_weights(self.model)
        copies: dict[int, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.model.state_dict().items():
            key = tensor.data_ptr()
            if key not in copies:
                copies[key] = tensor.detach().clone()
            out[name] = copies[key]
        return out

    def save(self, path: str, *, optimizer: bool = True) -> None:
        """Write the HF model folder into ``path``, plus ``optimizer.pt`` for a checkpoint. Under
        ``ddp`` rank 0 writes; under ``fsdp2`` every rank calls it: a checkpoint is each rank's
        shard (``torch.distributed.checkpoint``), a model without optimizer is gathered."""
        if self.lockstep and optimizer:
            save_sharded(self.model, self.optimizer, self.scheduler, path, self.rank)
            return
        state = full_state_dict(self.model) if self.lockstep else None  # every rank gathers
        if self.rank > 0:
            return
        os.makedirs(path, exist_ok=True)
        if self.lora is not None:
            save_merged(self.model, path, state)
        else:
            self.model.save_pretrained(path, state_dict=state)
        if optimizer:
            torch.save(self.optimizer.state_dict(), os.path.join(path, OPTIMIZER_FILE))
            if self.scheduler is not None:
                torch.save(self.scheduler.state_dict(), os.path.join(path, SCHEDULER_FILE))

    def load(self, path: str) -> None:
        """Restore weights (in place, so the optimizer keeps its parameters) and optimizer state."""
        if self.lockstep:
            load_sharded(self.model, self.optimizer, path)  # the scheduler below
        elif self.lora is not None:
            load_adapters(self.model, path)
        else:
            loaded = type(self.model).from_pretrained(path, dtype=torch.float32)
            self.model.load_state_dict(loaded.state_dict())
        if not self.lockstep:
            state = torch.load(os.path.join(path, OPTIMIZER_FILE), map_location=self.device, weights_only=True)
            self.optimizer.load_state_dict(state)
        self._restore_schedule(path)

    def _restore_schedule(self, path: str) -> None:
        """This engine's ``lr`` and schedule over the restored optimizer, at the checkpoint's
        update count: a resume may change both (``controller/checkpoint.RESUMABLE``), and the
        optimizer's and the scheduler's saved state hold the old rate."""
        file = os.path.join(path, SCHEDULER_FILE)
        if os.path.isfile(file):
            done = int(torch.load(file, weights_only=True)["last_epoch"])
        else:  # written without a schedule: AdamW counts its updates per parameter
            done = max((int(s["step"]) for s in self.optimizer.state.values() if "step" in s), default=0)
        lr = float(self._optimizer_args["lr"])  # type: ignore[arg-type]
        for group in self.optimizer.param_groups:  # the saved groups replaced ours: this engine's settings
            group["initial_lr"] = group["lr"] = lr
            group["foreach"] = self._foreach
        if self._lr_schedule is not None:
            self.scheduler = self._lr_schedule.build(self.optimizer, done)

    def plan_forwards(self, samples: Sequence[Sample], budget: int) -> list[list[list[int]]]:
        """Forward chunks → rows → sample indices, in the engine's layout."""
        if self.layout == "packed":
            return packed_chunks(samples, budget, self.pack_row_tokens, self.share_prompts)
        return [[[i] for i in part] for part in length_buckets(samples, budget)]

    def forward_inputs(self, rows: list[list[Sample]]) -> dict[str, torch.Tensor]:
        if self.layout == "packed":
            return pack_batch(rows, self.share_prompts)
        return pad_batch([s for row in rows for s in row])

    def _loss_inputs(self, mb: MicroBatch, rows: list[list[int]], with_entropy: bool = False) -> LossInputs:
        """Forward one chunk of a micro-batch with grad; all tensors ``[tokens]`` of its
        response tokens, in row-major sample order (``ref_logp`` when every sample carries
        reference log-probs, ``entropy`` on request)."""
        order = [i for row in rows for i in row]
        batch = self._to_device(self.forward_inputs([[mb.samples[i] for i in row] for row in rows]))
        logp, entropy = self._response_logprobs(batch, self.temperature, "loss" if with_entropy else "metric")
        advantages = flatten_rows([mb.advantages[i] for i in order], self.device)
        prox_logp = flatten_rows([mb.prox_logprobs[i] for i in order], self.device)
        if not advantages.shape == prox_logp.shape == logp.shape:
            raise ValueError(
                f"micro-batch signals misaligned: {advantages.numel()} advantages, "
                f"{prox_logp.numel()} prox log-probs, {logp.numel()} response tokens"
            )
        return LossInputs(
            logp=logp,
            prox_logp=prox_logp,
            behav_logp=batch["behav_logprobs"],
            advantages=advantages,
            mask=batch["loss_mask"],
            normaliser=mb.normaliser,
            seq_lengths=batch["response_lengths"],
            ref_logp=reference_logp([mb.samples[i] for i in order], self.device),
            entropy=entropy,
        )

    def _response_logprobs(
        self, batch: dict[str, torch.Tensor], temperature: float, entropy_for: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[N]`` log-probs of the response tokens under ``log_softmax(logits / T)``, and their
        distributions' ``[N]`` entropies: with a graph for the loss's term (``entropy_for="loss"``),
        detached for the ``entropy`` metric only (``"metric"``), or none (``None``)."""
        logits = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch.get("position_ids"),
            use_cache=False,
        ).logits  # [B, T, V]
        picked = logits[batch["logit_rows"], batch["logit_cols"]]  # [N, V]
        picked = picked.to(torch.promote_types(picked.dtype, torch.float32))  # bf16 logits: softmax in fp32
        if temperature > 0:
            picked = picked / temperature
        logp = torch.log_softmax(picked, dim=-1)
        entropy = None
        if entropy_for == "loss":
            entropy = token_entropy(logp)
        elif entropy_for == "metric":  # no graph, from the log-probs already here
            with torch.no_grad():
                entropy = token_entropy(logp.detach())
        return logp.gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1), entropy

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch on the engine's device (a packed layout's mask is boolean: any query dtype)."""
        return {k: v.to(self.device) for k, v in batch.items()}

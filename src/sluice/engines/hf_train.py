"""``TrainEngine`` for a Hugging Face causal LM trained in plain PyTorch (fp32, one device).

Role: the reference training engine. ``logprobs`` recomputes per-response-token
log-probs (proximal or reference policy) without grad; ``begin_step``, ``accumulate`` per
micro-batch and ``finish_step`` sum the gradients of an update's micro-batches, scale them by
the update's normaliser, so the accumulated gradient equals the full-batch gradient, then take
one gradient-norm clip and one AdamW step. Weights are exported as detached copies for weight
sync, and ``save`` / ``load`` round-trip model and optimizer state.

Forwards run in one of two layouts: ``packed`` (``engines/packing.py``: padding-free rows in
which a group's responses share one copy of its prompt) or ``padded`` (length-sorted, right-padded
chunks). Both give the same log-probs to float rounding; ``packed`` is about 2× faster on the
default task (``benchmarks/training.py``).

The learning rate follows an optional ``LrSchedule`` (warmup, then constant / linear / cosine
decay: ``transformers.get_scheduler``), stepped once per optimizer update and checkpointed
beside the optimizer. Deliberately not here: FSDP / tensor parallelism, mixed precision, gradient
checkpointing, and deciding micro-batch boundaries (the caller passes ``MicroBatch`` es from
``trainer/step.py``). Log-probs use ``log_softmax(logits / T)``
to match the engines' ``Completion.logprobs`` convention (``T <= 0`` means raw logits).
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from sluice.api.protocols import Algorithm
from sluice.api.types import LossInputs, MicroBatch, Sample
from sluice.engines.lora import LoraSpec, apply_lora, load_adapters, merged_weights, save_merged
from sluice.engines.lr_schedule import LrSchedule
from sluice.engines.packing import pack_batch, packed_chunks
from sluice.engines.padding import pad_batch

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "lr_scheduler.pt"


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
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self._params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.scheduler = lr_schedule.build(self.optimizer) if lr_schedule is not None else None

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> HFTrainEngine:
        """Load an fp32 model from an HF folder (no optimizer state; use ``load`` to resume)."""
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return cls(model, **kwargs)

    def logprobs(self, samples: Sequence[Sample], temperature: float) -> list[list[float]]:
        """Per-response-token log-probs of each sample under the current weights (no grad)."""
        result: list[list[float]] = [[] for _ in samples]
        self.model.eval()
        with torch.no_grad():
            for rows in self.plan_forwards(samples, self.forward_token_budget):
                batch = self._to_device(self.forward_inputs([[samples[i] for i in row] for row in rows]))
                flat = self._response_logprobs(batch, temperature)[0].cpu()
                lengths = batch["response_lengths"].tolist()
                indices = [i for row in rows for i in row]
                for i, part in zip(indices, torch.split(flat, lengths), strict=True):
                    result[i] = part.tolist()
        return result

    def begin_step(self) -> None:
        """Start a streamed step: clear gradients and the step's metric sums."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self._totals: dict[str, float] = defaultdict(float)

    def accumulate(self, mb: MicroBatch, algorithm: Algorithm) -> None:
        """Forward + backward one micro-batch as soon as it is ready (gradients add up).

        Inside the micro-batch, rows are sorted by length and run in chunks of at most
        ``padded_token_budget`` positions, so a long-tailed batch is not padded to its longest
        row. The chunking depends only on the micro-batch, so it is deterministic.
        """
        first = not self._totals["micro_batches"]
        for rows in self.plan_forwards(mb.samples, self.padded_token_budget):
            inputs = self._loss_inputs(mb, rows, algorithm.uses_entropy)
            if first:  # the train-inference log-prob gap, before this update changes the weights
                self._totals.update(logprob_gap(inputs))
                first = False
            out = algorithm.loss(inputs)
            out.loss.backward()
            self._totals["loss"] += float(out.loss.detach())
            for key, value in out.stats.items():
                self._totals[key] += value
        self._totals["micro_batches"] += 1.0
        self._totals["samples"] += float(len(mb.samples))

    def finish_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        """Scale the accumulated gradients (``1 / normaliser`` when micro-batches were summed
        with normaliser 1 because the step's size was not known yet), clip, AdamW step."""
        totals = self._totals
        if grad_scale != 1.0:
            for p in self._params:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
            totals["loss"] *= grad_scale
        max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params, max_norm))
        skipped = not math.isfinite(grad_norm)
        if skipped:
            logger.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm)
        else:
            self.optimizer.step()
        if self.scheduler is not None:  # a skipped update still moves along the schedule
            totals["lr"] = float(self.scheduler.get_last_lr()[0])
            self.scheduler.step()
        totals["skipped_steps"] = float(skipped)
        totals["grad_norm"] = grad_norm
        return dict(totals)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Detached copies of the state dict; tied tensors stay shared in the copy. With LoRA, the
        plain model's weights with the adapters merged in."""
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
        """Write the HF model folder into ``path``, plus ``optimizer.pt`` for a checkpoint."""
        os.makedirs(path, exist_ok=True)
        if self.lora is not None:
            save_merged(self.model, path)
        else:
            self.model.save_pretrained(path)
        if optimizer:
            torch.save(self.optimizer.state_dict(), os.path.join(path, OPTIMIZER_FILE))
            if self.scheduler is not None:
                torch.save(self.scheduler.state_dict(), os.path.join(path, SCHEDULER_FILE))

    def load(self, path: str) -> None:
        """Restore weights (in place, so the optimizer keeps its parameters) and optimizer state."""
        if self.lora is not None:
            load_adapters(self.model, path)
        else:
            loaded = type(self.model).from_pretrained(path, dtype=torch.float32)
            self.model.load_state_dict(loaded.state_dict())
        state = torch.load(os.path.join(path, OPTIMIZER_FILE), map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(torch.load(os.path.join(path, SCHEDULER_FILE), weights_only=True))

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
        logp, entropy = self._response_logprobs(batch, self.temperature, with_entropy)
        advantages = _flatten([mb.advantages[i] for i in order], self.device)
        prox_logp = _flatten([mb.prox_logprobs[i] for i in order], self.device)
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
        self, batch: dict[str, torch.Tensor], temperature: float, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[N]`` log-probs of the response tokens under ``log_softmax(logits / T)``, and their
        distributions' ``[N]`` entropies when ``with_entropy``."""
        logits = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch.get("position_ids"),
            use_cache=False,
        ).logits  # [B, T, V]
        picked = logits[batch["logit_rows"], batch["logit_cols"]]  # [N, V]
        if temperature > 0:
            picked = picked / temperature
        logp = torch.log_softmax(picked, dim=-1)
        entropy = token_entropy(logp) if with_entropy else None
        return logp.gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1), entropy

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in batch.items()}


def length_buckets(samples: Sequence[Sample], padded_token_budget: int) -> list[list[int]]:
    """Sample indices in length-sorted parts of at most ``padded_token_budget`` padded positions
    (a row longer than the budget goes alone)."""
    order = sorted(range(len(samples)), key=lambda i: (samples[i].num_tokens, i))
    parts: list[list[int]] = []
    for i in order:
        longest = samples[i].num_tokens  # ascending, so the newest row is the longest
        if parts and (len(parts[-1]) + 1) * longest <= padded_token_budget:
            parts[-1].append(i)
        else:
            parts.append([i])
    return parts


def token_entropy(logp_all: torch.Tensor) -> torch.Tensor:
    """``[tokens]`` entropy of each row of ``logp_all [tokens, vocab]`` (log-probabilities)."""
    return -(torch.exp(logp_all) * logp_all).sum(dim=-1)


def reference_logp(samples: Sequence[Sample], device: torch.device) -> torch.Tensor | None:
    """``[tokens]`` reference log-probs of ``samples``, or ``None`` unless every sample has them."""
    if not all(len(s.ref_logprobs) == len(s.response_ids) for s in samples):
        return None
    return _flatten([s.ref_logprobs for s in samples], device)


def _flatten(rows: Sequence[Sequence[float]], device: torch.device) -> torch.Tensor:
    """Ragged per-sample values → ``[tokens]`` float32."""
    return torch.tensor([x for row in rows for x in row], dtype=torch.float32, device=device)


def logprob_gap(inputs: LossInputs) -> dict[str, float]:
    """Mean and max ``|behaviour log-prob − the trainer's log-prob|`` over the loss tokens of one
    forward chunk (engine-vs-trainer drift; with stale samples it includes the policy's lag)."""
    mask = inputs.mask.bool()
    gap = (inputs.behav_logp - inputs.logp.detach()).abs()[mask]
    if not gap.numel():
        return {}
    return {"logprob_gap_mean": float(gap.mean()), "logprob_gap_max": float(gap.max())}

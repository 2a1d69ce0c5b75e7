"""Wire types: the frozen dataclasses that cross every seam of sluice.

They carry plain Python lists (token ids, log-probs, versions) so they pickle cheaply through
Ray and never pin a torch tensor to an engine. Batching into tensors happens inside the trainer,
not here. No behaviour beyond trivial derived properties.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled. ``temperature == 0`` means greedy (argmax)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate. ``seed`` makes its sampling independent of batching.

    ``affinity`` names requests that would rather share a replica (the samples of one prompt:
    prefix sharing); a router may honour it (``LLMProxy`` without prompt replication) or not.
    ``session`` names the multi-turn episode the request is a turn of: an engine may keep this
    turn's KV cache for the session's next request, whose prompt extends it (the built-in engine's
    ``rollout.session_cache_mib``).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int = 0
    affinity: str | None = None
    session: str | None = None


@dataclass(frozen=True)
class Completion:
    """What an engine returns for one request.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the sampling distribution
    (logits divided by the temperature, before top-p truncation; raw logits when greedy), and
    ``versions[i]`` the policy version of the weights that produced it.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason


@dataclass(frozen=True)
class PromptItem:
    """One dataset row after validation: a tokenised prompt plus the fields its reward needs."""

    index: int
    prompt: str
    prompt_ids: tuple[int, ...]
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Sample:
    """One scored response: the unit the trainer consumes.

    A sample's policy version is its oldest token's (``version``), per DESIGN.md.
    """

    uid: str
    group_id: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    behav_logprobs: tuple[float, ...]
    token_versions: tuple[int, ...]
    loss_mask: tuple[int, ...]
    reward: float
    meta: dict[str, Any] = field(default_factory=dict)
    ref_logprobs: tuple[float, ...] = ()
    """Log-probs of the response under the frozen reference policy; empty until a reference
    step has written them (only runs with a KL term need them)."""

    @property
    def version(self) -> int:
        return min(self.token_versions) if self.token_versions else 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True)
class LossInputs:
    """Per-token tensors of one micro-batch, all ``[tokens]`` (flattened, response tokens only).

    ``normaliser`` is the step-wide denominator (e.g. the number of loss tokens in the whole
    global batch), so micro-batch losses add up to the full-batch loss. ``seq_lengths``
    ``[seqs]`` gives the sequence boundaries (response tokens per sample, in order) that
    sequence-level losses and aggregation modes need; ``None`` when unknown. ``ref_logp``
    (frozen reference policy) and ``entropy`` (of the current policy, with grad) are ``[tokens]``
    too, present when the algorithm's KL / entropy terms need them.
    """

    logp: torch.Tensor
    prox_logp: torch.Tensor
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    normaliser: float
    seq_lengths: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


@dataclass(frozen=True)
class LossOutputs:
    """A scalar loss to backpropagate plus detached statistics (sums, not means)."""

    loss: torch.Tensor
    stats: dict[str, float]


@dataclass(frozen=True)
class MicroBatch:
    """A slice of one training step: samples plus their per-token training signals.

    ``advantages[i]`` and ``prox_logprobs[i]`` align with ``samples[i].response_ids``.
    ``normaliser`` is the step-wide denominator shared by every micro-batch of the step.
    """

    samples: tuple[Sample, ...]
    advantages: tuple[tuple[float, ...], ...]
    prox_logprobs: tuple[tuple[float, ...], ...]
    normaliser: float

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


@dataclass(frozen=True)
class GroupReport:
    """What a rollout worker tells the controller about one prompt group (metadata, never data).

    The samples themselves went to the TransferQueue (unless ``discard_reason`` is set, in which
    case a named filter dropped the whole group). ``version`` is the group's oldest token's.
    """

    group_id: int
    version: int
    num_samples: int
    response_tokens: int
    rewards: tuple[float, ...]
    discard_reason: str | None = None
    finished_at: float = 0.0
    sample_versions: tuple[int, ...] = ()
    """Each sample's oldest token's version, in sample order (empty: not reported)."""
    failed_by: str | None = None
    """What failed the group when a failure discarded it: ``reward 'NAME'`` or ``environment
    'NAME'`` (``None``: no failure; the run's failure budget counts these)."""
    error: str = ""
    """That failure's error text (the group's first failed reward call, or last failed episode)."""
    response_lengths: tuple[int, ...] = ()
    """Each sample's response tokens, in sample order (empty: not reported)."""
    truncated: int = 0
    """Samples cut at the response cap (``finish_reason == "length"``)."""
    data_source: str = ""
    """The prompt's ``data_source`` (empty: not reported)."""
    rm_scores: tuple[float, ...] = ()
    """Each sample's reward-model score before combining (``reward.model``; empty: none)."""


@dataclass(frozen=True)
class Credit:
    """A multi-controller run's admission credit for one prompt group (``run.controller: multi``)."""

    group_id: int
    step: int
    """The training step (global batch, queue partition) whose slot the group fills."""
    version: int
    """The policy version every engine held when the credit was granted."""

"""The seams of sluice as ``typing.Protocol`` s, each small (at most 8 methods).

Components depend on these, never on each other's classes, and never on the controller.
Implementations live in their rooms: ``engines/`` (inference and training engines),
``weights/`` (weight sync), ``trainer/algos`` (algorithms), ``rewards/`` (reward functions).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from sluice.api.types import (
    Completion,
    Credit,
    GenerationRequest,
    GroupReport,
    LossInputs,
    LossOutputs,
    MicroBatch,
    Sample,
)

if TYPE_CHECKING:
    import torch

WeightUpdateMode = Literal["interrupt", "defer", "staggered"]


@runtime_checkable
class InferenceEngine(Protocol):
    """Generates completions; holds one version of the policy weights at a time."""

    async def generate(self, request: GenerationRequest) -> Completion:
        """Generate one sequence; resolves when it stops, hits its length or is aborted."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request; its ``generate`` resolves with ``finish_reason='abort'``."""
        ...

    def pause(self) -> None:
        """Stop scheduling decode steps (requests stay queued)."""
        ...

    def resume(self) -> None:
        """Undo ``pause``."""
        ...

    def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: int, mode: WeightUpdateMode = "interrupt"
    ) -> None:
        """Load new weights; tokens generated afterwards carry ``version``."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters for telemetry (running, waiting, generated tokens, ...)."""
        ...


@runtime_checkable
class VersionedEngine(InferenceEngine, Protocol):
    """An engine that holds its weights itself (HF, vLLM, SGLang, simulated), as one replica of a
    fleet does; the ``LLMProxy`` in front of replicas is an ``InferenceEngine`` but not this."""

    version: int
    """The weights version new tokens are generated with."""

    def weights_checksum(self) -> float:
        """A fingerprint of the weights it holds (the float64 sum of every element, tied aliases
        once): a resumed or replaced replica proves it holds the trainer's weights."""
        ...


@runtime_checkable
class ExpectsRequests(Protocol):
    """An in-process engine that can wait, briefly, for requests it is told are on their way (an
    agent's next call, a round trip after its last answer) instead of decoding a batch they
    outnumber (``engines/arrival_hold.py``)."""

    def expect_requests(self, expected: Callable[[], float], hold: float) -> None:
        """``expected()``: requests known to be coming to this engine; ``hold``: the longest wait
        before a step, in multiples of the engine's recent step time (0: never wait)."""
        ...


@runtime_checkable
class Replica(Protocol):
    """One inference engine as ``LLMProxy`` drives it: ``InferenceEngine``'s verbs, all coroutines,
    so an in-process engine and a Ray actor handle look alike (``rollout/replicas.py`` adapts both).
    ``update_weights`` returns once the engine has taken the update (loaded, or staged for a drain);
    ``stats()['version']`` tells when it holds it."""

    async def generate(self, request: GenerationRequest) -> Completion: ...

    async def abort(self, request_id: str) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: int, mode: WeightUpdateMode
    ) -> None: ...

    async def stats(self) -> dict[str, float]: ...


class ReplicaLost(RuntimeError):
    """Raised by any ``Replica`` verb when the replica's process died: nothing it held survives,
    so its requests must continue on another replica (``LLMProxy`` does that)."""


@runtime_checkable
class TrainEngine(Protocol):
    """Owns the trainable policy and its optimizer; the trainer drives one optimizer update as
    ``begin_step``, ``accumulate`` per micro-batch (in the order the trainer cut them, possibly
    while the step's groups still arrive), then ``finish_step``."""

    def begin_step(self) -> None:
        """Start an optimizer update: clear the gradients and the update's metric sums."""
        ...

    def accumulate(self, mb: MicroBatch, algorithm: Algorithm) -> None:
        """Forward and backward one micro-batch at once; gradients add up over the update.

        The loss is ``algorithm.loss`` of the micro-batch's response tokens (``[tokens]``
        tensors, ``LossInputs``), divided by ``mb.normaliser`` (1 when the trainer scales the
        whole update in ``finish_step``).
        """
        ...

    def finish_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        """Multiply the summed gradients by ``grad_scale`` (``1 / normaliser`` of the update),
        clip, take one optimizer step. Returns the update's metrics: ``loss`` (scaled), the
        algorithm's stat sums, ``grad_norm`` (before clipping), ``micro_batches``, ``samples``,
        ``skipped_steps``."""
        ...

    def logprobs(self, samples: Sequence[Sample], temperature: float) -> list[list[float]]:
        """``[samples][response tokens]`` log-probs under the current weights (no grad)."""
        ...

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        """A detached copy of the named parameters, for weight sync (a sharded engine's may be
        gathered as it is read)."""
        ...

    def save(self, path: str, *, optimizer: bool = True) -> None:
        """Write the model (HF folder) and, for a checkpoint, the optimizer state (``optimizer=False``:
        only what ``from_pretrained`` needs, e.g. the final model)."""
        ...

    def load(self, path: str) -> None:
        """Restore what ``save`` wrote."""
        ...


@runtime_checkable
class Algorithm(Protocol):
    """An advantage estimator plus a policy loss, composed over three policies (DESIGN.md)."""

    whole_batch_advantages: bool
    """True when advantages depend on the whole step (global whitening): a streaming trainer
    then holds the step's samples until the last group has arrived."""

    uses_entropy: bool
    """True when ``loss`` reads ``LossInputs.entropy`` (an entropy bonus): the train engine then
    computes the current policy's per-token entropy, with grad."""

    uses_reference: bool
    """True when the algorithm needs ``Sample.ref_logprobs`` (a KL to the reference policy): a
    reference step must write them before a sample is trained."""

    def advantages(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Per-response-token advantages, aligned with ``samples``."""
        ...

    def loss(self, inputs: LossInputs) -> LossOutputs:
        """The policy loss of one micro-batch, normalised by ``inputs.normaliser``."""
        ...

    def normaliser(self, samples: Sequence[Sample]) -> float:
        """The step-wide loss denominator of these samples (the loss's aggregation mode decides:
        loss tokens for token-mean, sequences for the seq-mean modes)."""
        ...


@runtime_checkable
class WeightSync(Protocol):
    """Moves versioned weights from the trainer to the engines."""

    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None: ...

    def fetch(self, version: int) -> Mapping[str, torch.Tensor]: ...

    def latest_version(self) -> int: ...


@runtime_checkable
class LengthPredictor(Protocol):
    """Predicts how long the responses to a prompt will be, learning online from the lengths the
    policy actually produced (StreamRL's output-length ranker). Schedulers use only the ranking
    of the predictions (longest first, the predicted long tail), never their scale."""

    def predict(self, prompts: Sequence[Sequence[int]]) -> list[float]:
        """Predicted response length (tokens) of each prompt (token ids), aligned with ``prompts``."""
        ...

    def observe(self, prompt_ids: Sequence[int], length: int) -> None:
        """Learn from one finished response: ``length`` tokens generated for ``prompt_ids``."""
        ...


class RewardFn(Protocol):
    """A reward: the decoded response plus the dataset row's fields → a float (sync or async).

    It receives text rather than a ``Sample`` because it runs before the sample exists
    (rewards decide dynamic filtering). ``fields`` are the row's columns, e.g. ``answer``.
    """

    def __call__(self, response: str, **fields: Any) -> float | Awaitable[float]: ...


class RewardFailure(Exception):
    """Raised by a reward call that produced no usable number (it raised, timed out, or returned
    NaN / a non-number). ``reason`` (``reward_<kind>:<name>``) becomes the discard reason of the
    sample's group: the run goes on without it."""

    def __init__(self, kind: str, name: str, detail: str) -> None:
        super().__init__(f"reward {name!r} failed ({kind}): {detail}")
        self.kind = kind
        self.name = name
        self.reason = f"reward_{kind}:{name}"
        self.detail = detail
        """The error itself (``ValueError: boom``, ``returned nan, not a finite number``)."""


class AdmissionCredits(Protocol):
    """Where a multi-controller rollout worker takes admission credits and reports its groups
    (the run's ``StepGate``, reached by a small call: no sample bytes)."""

    async def acquire(self, n: int) -> list[Credit]:
        """Up to ``n`` credits, waiting for a free slot; empty when the run admits no more."""
        ...

    async def report(self, report: GroupReport) -> None:
        """The group ended: kept (its rows are in the queue) or discarded by a named filter."""
        ...

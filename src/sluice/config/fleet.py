"""Config section ``fleet``: how the rollout's inference replicas are fed requests and receive
weights. ``config/models.py`` hooks it into a run's config; this module only declares and
validates.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sluice.config.section import Section as _Section


class FleetConfig(_Section):
    lpt: bool = False
    """Longest-predicted-first dispatch (StreamRL): an online length ranker predicts each
    request's response length from its prompt (learning from every finished response) and the
    LLMProxy holds requests itself, giving each free engine slot (``rollout.max_batch`` per
    replica) to the waiting request with the longest prediction, and routing by predicted
    rather than maximum length. Turn it on when responses are long-tailed and prompts wait for
    slots (more samples in flight than ``rollout.max_batch`` × replicas): long samples start first
    instead of last."""

    length_ranker: Literal["ridge", "model"] = "ridge"
    """``lpt``: what predicts response lengths. ``ridge`` (an online ridge regression on hashed
    prompt tokens and token pairs: microseconds per observation) or ``model`` (StreamRL's learned
    ranker: a tiny causal sequence model, a GRU over the prompt's tokens with a regression head,
    trained every 64 finished samples on the run's latest 4,096, on a thread beside the rollout
    worker's loop; about 12 ms of CPU per finished sample). Use ``model`` when lengths follow
    rules over where tokens sit in the prompt (an instruction at its end, a count of
    sub-questions): on such a workload it found 84 % of the longest 20 % against the ridge's 33 %
    (docs/rollout.md)."""

    long_tail_replicas: int = Field(default=0, ge=0)
    """Skewness-aware dispatch (StreamRL): replicas dedicated to the requests the length ranker
    predicts to be in the long tail (longer than all but the top ``long_tail_share`` of the last
    1,024 requests, all as the ranker predicts them now). They run at most ``long_tail_max_batch``
    requests at once, so past the engine's batch-size knee they decode faster per token; the other
    replicas run the rest at ``rollout.max_batch``. Each side has its own longest-first queue; while one side has no
    replica (all removed), its requests go to the other. 0 turns it off. Turn it on when lengths
    are long-tailed and predictable and the step waits for its longest responses decoding in full
    batches; choose the count so the dedicated replicas' share of the fleet matches the long
    tail's share of the tokens. Needs ``fleet.lpt`` and fewer than ``resources.rollout.replicas``."""

    long_tail_share: float = Field(default=0.2, gt=0.0, lt=1.0)
    """``long_tail_replicas > 0``: the share of requests treated as long tail (StreamRL: 20 %),
    judged against the last 1,024 requests."""

    long_tail_max_batch: int = Field(default=16, ge=1)
    """``long_tail_replicas > 0``: running requests per dedicated replica (at most
    ``rollout.max_batch``); the engine's batch-size knee, where per-token time starts to grow, is
    the natural choice."""

    rebalance: bool = False
    """Dynamic rebalancing (StreamRL §4): after each step, the replicas' measured busy time (per
    replica), the trainer's compute time and the step's time, averaged over ``rebalance_window``
    steps, go into ``sluice plan``'s step model, which predicts the step with one replica more and
    one fewer: a replica is added (up to ``resources.rollout.max_replicas``) when it is predicted to
    cut the step by at least a quarter of its share (1 / (replicas + 1)), removed (down to
    ``resources.rollout.min_replicas``) when one fewer is predicted to leave the step as it is (the
    trainer waits for nothing). A removed replica's requests continue on another from their partial
    responses (nothing regenerated, nothing lost); an added one loads the newest weights first. Each
    change is a ``rebalance`` record in ``metrics.jsonl`` with its reason and prediction, and the
    count is checkpointed (a resume starts with it). Turn it on when response lengths drift during a
    run (generation grows or shrinks relative to training) and there are devices or cores for more
    replicas; ``sluice plan --out`` writes these keys. Single controller (``run.controller:
    single``) only."""

    rebalance_window: int = Field(default=2, ge=1)
    """``rebalance``: steps averaged per decision (an async step alternates long and short;
    ``sluice plan`` writes 1 for ``run.mode: sync``)."""

    rebalance_cooldown: int = Field(default=2, ge=1)
    """``rebalance``: steps to let pass after a change before the next (at least
    ``rebalance_window``, so the measurement reflects the change; ``sluice plan`` writes
    η + 1, the steps within which groups admitted before the change are trained)."""

    weight_transfer: Literal["object_store", "broadcast"] = "object_store"
    """How a new policy version travels from trainer rank 0 to the rollout worker:
    ``object_store`` (one ``ray.put`` per version, fetched on demand; works on any Ray cluster) or
    ``broadcast`` (a torch.distributed group of trainer rank 0 and the rollout worker, gloo on CPU,
    NCCL on CUDA: each version is pushed as soon as it is published, beside the next training
    step, so the sync finds it already there). Use ``broadcast`` when weights are large relative to
    a step (the object store copies them twice and fetches only when asked); ``run.backend: ray``
    only; the group meets at a port on trainer rank 0's node, at its IP as Ray knows it, so the
    rollout may run on another node."""

    broadcast_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``weight_transfer: broadcast``: the collective library (``auto``: NCCL when CUDA is
    available, gloo otherwise)."""

    broadcast_timeout_s: float = Field(default=1800.0, gt=0.0)
    """``weight_transfer: broadcast``: how long the group's rendezvous or one broadcast may wait
    (a receiver waits inside a broadcast for the next version, so keep it above a step's time)."""


def check_fleet(fleet: FleetConfig, backend: str, controller: str = "single") -> None:
    """Refuse fleet options the run's placement cannot honour (one clear error)."""
    if fleet.rebalance and controller != "single":
        raise ValueError("fleet.rebalance needs run.controller: single (the driver measures each step)")
    if fleet.rebalance and fleet.rebalance_cooldown < fleet.rebalance_window:
        raise ValueError(
            f"fleet.rebalance_cooldown ({fleet.rebalance_cooldown}) must be at least fleet.rebalance_window "
            f"({fleet.rebalance_window})"
        )
    if fleet.rebalance and fleet.weight_transfer == "broadcast":
        raise ValueError(
            "fleet.rebalance needs fleet.weight_transfer: object_store (a broadcast group's ranks are "
            "fixed when it meets: a replica added later could not join it)"
        )
    if fleet.long_tail_replicas and not fleet.lpt:
        raise ValueError("fleet.long_tail_replicas needs fleet.lpt: true (the long tail is what the ranker predicts)")
    if fleet.weight_transfer == "broadcast" and backend != "ray":
        raise ValueError(
            "fleet.weight_transfer: broadcast needs run.backend: ray (trainer and engines in separate processes)"
        )

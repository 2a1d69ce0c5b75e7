"""One RL training step: the one implementation every trainer path runs.

``train_global_batch`` is the step over a global batch that is all here: advantages (the
algorithm's, or GAE from a critic's values), proximal log-probs once, every optimizer update of
the schedule (PPO mini-batches and epochs, ``trainer/updates.py``), then the critic's updates on
the same cuts. Under data parallelism a ``StepShare`` gives it the whole step (every rank's
samples), so the advantages, the whitening and each mini-batch's normaliser span all ranks while
the rank trains its own samples and the engine sums the gradients.

``RLStep`` is how a trainer rank receives a step: samples arrive in step order, group by group.
It holds them and runs ``train_global_batch`` when the step finishes (packing each update into the
fewest micro-batches) — unless the step can stream (one update, advantages per group, no critic,
no collective forwards), in which case each
micro-batch is accumulated as soon as it is complete and the step's normaliser is applied at the
end: the same floating-point operations in the same order, so both paths give the same bits
(``trainer/step.py``). The streamed step is the fast path of ``train_global_batch``, not a second
algorithm. Deliberately not here: reading rows (``trainer/worker.py``), publishing weights, and
the models themselves (the engines).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from sluice.api import Algorithm, MicroBatch, Sample, TrainEngine
from sluice.engines.critic import CriticEngine
from sluice.telemetry.trace import SpanRecorder
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.data_parallel import DataParallelGroup
from sluice.trainer.ppo import CriticSpec, StepShare, critic_updates, gae_targets, loss_token_mean
from sluice.trainer.step import InOrderPacker, step_normaliser
from sluice.trainer.updates import (
    UpdateSchedule,
    merge_update_metrics,
    mini_batch_plan,
    mini_batch_ranges,
    proximal_logprobs,
    run_updates,
    streamable,
)


def train_global_batch(
    engine: TrainEngine,
    samples: Sequence[Sample],
    algorithm: Algorithm,
    micro_batch_tokens: int,
    schedule: UpdateSchedule,
    temperature: float,
    *,
    critic: CriticEngine | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    values: Sequence[Sequence[float]] | None = None,
    share: StepShare | None = None,
) -> dict[str, float]:
    """One training step over ``samples`` (this trainer's); returns the merged metrics. With a
    ``critic`` (PPO) the advantages are GAE (``gamma``, ``lam``) over the critic's ``values`` of
    the samples (taken now unless given: the asynchronous trainer reads them from the queue),
    and the critic takes the actor's schedule of value-regression updates after it. ``share``:
    under data parallelism, the whole step over every rank (advantages, whitening and each
    mini-batch's normaliser span it; the engines sum the ranks' gradients)."""
    if share is None:
        if values is None:
            values = critic.values(samples) if critic is not None else [[] for _ in samples]
        share = StepShare(samples, values, range(len(samples)))
    if critic is None:
        everyone = algorithm.advantages(share.samples)
        returns: list[list[float]] = []
    else:
        assert isinstance(algorithm, GRPOAlgorithm), "PPO's GAE needs the built-in algorithm"
        everyone, returns = gae_targets(share.samples, share.values, algorithm, gamma, lam)
    prox = proximal_logprobs(engine, samples, schedule, temperature)
    plan = mini_batch_plan(share.samples, algorithm, schedule.mini_batches, share.mine)
    advantages = [everyone[i] for i in share.mine]
    balanced = not streamable(schedule, algorithm, critic is not None)
    metrics = merge_update_metrics(
        run_updates(engine, samples, advantages, prox, algorithm, micro_batch_tokens, schedule, plan, balanced)
    )
    if critic is not None:
        whole = mini_batch_ranges(len(share.samples), schedule.mini_batches)  # the cuts of ``plan``
        tokens = [float(sum(sum(share.samples[i].loss_mask) for i in part)) for part in whole]
        parts = [(part.mine, total) for part, total in zip(plan, tokens, strict=True)]
        mine_returns = [returns[i] for i in share.mine]
        mine_values = [share.values[i] for i in share.mine]
        metrics.update(critic_updates(critic, samples, mine_returns, mine_values, schedule, parts))
        metrics["value_mean"] = loss_token_mean(share.values, share.samples)
        metrics["return_mean"] = loss_token_mean(returns, share.samples)
    return metrics


class RLStep:
    """One training step as a trainer rank receives it (``add`` in step order, then ``finish``)."""

    def __init__(
        self,
        engine: TrainEngine,
        algorithm: Algorithm,
        schedule: UpdateSchedule,
        micro_batch_tokens: int,
        temperature: float,
        tracer: SpanRecorder,
        *,
        critic: tuple[CriticEngine, CriticSpec] | None = None,
        dp: DataParallelGroup | None = None,
        hold: bool = False,
    ) -> None:
        self.engine, self.algorithm, self.schedule = engine, algorithm, schedule
        self.micro_batch_tokens, self.temperature, self.tracer = micro_batch_tokens, temperature, tracer
        self.critic, self.dp = critic, dp
        self.streams = streamable(schedule, algorithm, critic is not None) and not hold
        """Micro-batches run as they complete; else the step is held for ``train_global_batch``
        (whole-batch advantages, several updates, a critic, or ``hold``: e.g. ``fsdp2``, whose
        forwards are collectives the ranks must run together)."""
        self.timing = {"wait_data_s": 0.0, "first_microbatch_at": 0.0}
        self._packer = InOrderPacker(micro_batch_tokens)
        self._held: list[Sample] = []
        self._values: list[list[float]] = []
        self._positions: list[int] = []
        engine.begin_step()

    def add(
        self, samples: Sequence[Sample], values: Sequence[list[float]], positions: Mapping[int, int] | None = None
    ) -> None:
        """The next samples of the step, in step order, with their critic values (empty lists
        without a critic); ``positions``: each group's place in the whole step (data parallelism;
        default: after the groups added before)."""
        if self.streams:
            prox = proximal_logprobs(self.engine, samples, self.schedule, self.temperature)
            for mb in self._packer.add(samples, self.algorithm.advantages(samples), prox):
                self._accumulate(mb)
            return
        if positions is None:
            start = self._positions[-1] + 1 if self._positions else 0
            groups = dict.fromkeys(s.group_id for s in samples)
            positions = {gid: start + k for k, gid in enumerate(groups)}
        self._held.extend(samples)
        self._values.extend(values)
        self._positions.extend(positions[s.group_id] for s in samples)

    def finish(self) -> tuple[dict[str, float], list[Sample]]:
        """The optimizer step(s): the metrics (summed over the ranks) and the step's samples (every
        rank's)."""
        if not self.streams:
            share = self._share()
            with self.tracer.span("optimizer_step", lane="trainer", updates=self.schedule.updates):
                metrics = train_global_batch(
                    _Traced(self), self._held, self.algorithm, self.micro_batch_tokens, self.schedule,
                    self.temperature, share=share, **self._critic_args(),
                )  # fmt: skip
                metrics = self.dp.sum_metrics(metrics) if self.dp is not None else metrics
            return metrics, list(share.samples)
        for mb in self._packer.flush():
            self._accumulate(mb)
        with self.tracer.span("optimizer_step", lane="trainer"):
            step_samples = self._everyone(self._packer.samples)
            metrics = self.engine.finish_step(grad_scale=1.0 / step_normaliser(step_samples, self.algorithm))
            metrics = self.dp.sum_metrics(metrics) if self.dp is not None else metrics
        return metrics, step_samples

    def _critic_args(self) -> dict[str, Any]:
        if self.critic is None:
            return {}
        engine, spec = self.critic
        return {"critic": engine, "gamma": spec.gamma, "lam": spec.lam}

    def _share(self) -> StepShare:
        """The whole step's samples and critic values in step order (every rank's, by group
        position) and the positions in it of this rank's held samples (already in step order)."""
        if self.dp is None:
            return StepShare(self._held, self._values, range(len(self._held)))
        parts = self.dp.all_gather(list(zip(self._positions, self._held, self._values, strict=True)))
        keyed = sorted((pos, rank, k) for rank, part in enumerate(parts) for k, (pos, _, _) in enumerate(part))
        step_samples = [parts[rank][k][1] for _, rank, k in keyed]
        step_values = [parts[rank][k][2] for _, rank, k in keyed]
        mine = [i for i, (_, rank, _) in enumerate(keyed) if rank == self.dp.rank]
        return StepShare(step_samples, step_values, mine)

    def _everyone(self, samples: list[Sample]) -> list[Sample]:
        """The whole step's samples over all data-parallel ranks (rank order); ``samples`` alone."""
        if self.dp is None:
            return samples
        return [s for part in self.dp.all_gather(samples) for s in part]

    def _accumulate(self, mb: MicroBatch) -> None:
        if not self.timing["first_microbatch_at"]:
            self.timing["first_microbatch_at"] = time.time()
        with self.tracer.span("train_microbatch", lane="trainer", samples=len(mb.samples)):
            self.engine.accumulate(mb, self.algorithm)


class _Traced:
    """The step's engine with each micro-batch traced as the streaming path traces it."""

    def __init__(self, step: RLStep) -> None:
        self.step = step

    def logprobs(self, samples: Sequence[Sample], temperature: float) -> list[list[float]]:
        return self.step.engine.logprobs(samples, temperature)

    def begin_step(self) -> None:
        self.step.engine.begin_step()

    def accumulate(self, mb: MicroBatch, algorithm: Algorithm) -> None:
        self.step._accumulate(mb)

    def finish_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        return self.step.engine.finish_step(grad_scale)

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        return self.step.engine.export_weights()

    def save(self, path: str, *, optimizer: bool = True) -> None:
        self.step.engine.save(path, optimizer=optimizer)

    def load(self, path: str) -> None:
        self.step.engine.load(path)

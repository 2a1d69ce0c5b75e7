"""Profiling refinement of the cost model: least-squares fits of measured phase times.

- ``fit_decode(batches, seconds)``: a decode iteration's time against its running batch, as
  ``SimEngine``'s ``decode_s · max(1, batch / knee)`` (flat while memory-bound, linear after);
- ``fit_linear(xs, seconds)``: intercept + slope (a training micro-batch against its tokens,
  prefill against prompt tokens);
- ``refine(cost, ...)``: turns the fitted numbers into the ``Efficiency`` of a ``CostModel`` so
  the analytic model reproduces the measurement and extrapolates to other shapes and counts.

``measure_host`` measures this host's matmul FLOP/s and copy bandwidth as a ``DeviceSpec`` (the
``cpu`` preset's numbers); the phase times come from ``benchmarks/planner_validation.py``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from sluice.sim.cost_model import DEVICES, CostModel, DeviceSpec, analytic_memory_bound_s


@dataclass(frozen=True)
class DecodeFit:
    decode_s: float
    knee: float
    rms_s: float
    """Root-mean-square residual of the fit."""

    def predict(self, batch: float) -> float:
        return self.decode_s * max(1.0, batch / self.knee)


@dataclass(frozen=True)
class LinearFit:
    intercept: float
    slope: float
    rms_s: float

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x


def _check(xs: Sequence[float], ys: Sequence[float], least: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"need two equally long 1-d sequences, got {x.shape} and {y.shape}")
    if len(np.unique(x)) < least:
        raise ValueError(f"need at least {least} distinct x values to fit, got {len(np.unique(x))}")
    return x, y


def fit_decode(batches: Sequence[float], seconds: Sequence[float]) -> DecodeFit:
    """Least squares over the knee (a fine grid, then a local refinement); for a given knee the
    model is linear in ``decode_s``, which has a closed form."""
    x, y = _check(batches, seconds, 2)

    def solve(knee: float) -> tuple[float, float]:
        f = np.maximum(1.0, x / knee)
        d = float(f @ y / (f @ f))
        return float(np.sum((d * f - y) ** 2)), d

    grid = np.geomspace(max(x.min() / 2, 1e-3), x.max() * 2, 400)
    errors = [solve(k)[0] for k in grid]
    best = int(np.argmin(errors))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    fine = np.linspace(lo, hi, 200)
    knee = float(fine[int(np.argmin([solve(k)[0] for k in fine]))])
    sse, decode = solve(knee)
    return DecodeFit(decode, knee, float(np.sqrt(sse / len(x))))


def fit_linear(xs: Sequence[float], seconds: Sequence[float]) -> LinearFit:
    x, y = _check(xs, seconds, 2)
    slope, intercept = np.polyfit(x, y, 1)
    rms = float(np.sqrt(np.mean((intercept + slope * x - y) ** 2)))
    return LinearFit(float(intercept), float(slope), rms)


def refine(
    cost: CostModel,
    *,
    decode: DecodeFit | None = None,
    context: float = 0.0,
    train: LinearFit | None = None,
    train_devices: int = 1,
    tp: int = 1,
) -> CostModel:
    """A copy of ``cost`` whose efficiencies reproduce the fitted decode iteration (flat part
    and slope at ``context`` tokens) and training micro-batch (fixed cost and per-token slope)."""
    eff = cost.eff
    if decode is not None:
        # The flat part is weights over bandwidth plus a fixed cost: keep the analytic split of
        # bandwidth-bound time, attribute what the bandwidth cannot explain to the overhead.
        memory_bound = analytic_memory_bound_s(cost.model, cost.device, tp, eff)
        overhead = max(decode.decode_s - memory_bound, 0.0)
        scale = decode.decode_s / memory_bound if overhead == 0.0 else 1.0
        eff = replace(eff, decode_bw=eff.decode_bw / scale, decode_overhead_s=overhead)
        refined = replace(cost, eff=eff)
        per_seq_measured = decode.decode_s / decode.knee
        kv = refined.decode_per_seq_s(context, tp) - refined.decode_per_seq_s(0.0, tp)
        compute = max(per_seq_measured - kv, 1e-12)
        eff = replace(eff, decode_flops=2.0 * cost.model.params / (cost.device.peak_flops * tp * compute))
    if train is not None:
        per_token = max(train.slope, 1e-15)
        mfu = 6.0 * cost.model.params / (cost.device.peak_flops * train_devices * per_token)
        eff = replace(eff, train_flops=mfu, microbatch_overhead_s=max(train.intercept, 0.0))
    return replace(cost, eff=eff)


def measure_host(seconds: float = 0.5) -> DeviceSpec:
    """Measure this host's FP32 matmul FLOP/s and copy bandwidth (one thread each, best of a
    few tries) and return it as a ``DeviceSpec`` (memory and price from the ``cpu`` preset)."""
    import torch

    a = torch.randn(512, 512)
    flops = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(8):
            a @ a
        flops = max(flops, 8 * 2 * 512**3 / (time.perf_counter() - start))
    src = torch.empty(32 * 1024**2, dtype=torch.uint8)
    dst = torch.empty_like(src)
    bw = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        dst.copy_(src)
        bw = max(bw, 2 * src.numel() / (time.perf_counter() - start))  # read + write
    return replace(DEVICES["cpu"], peak_flops=flops, mem_bw=bw)

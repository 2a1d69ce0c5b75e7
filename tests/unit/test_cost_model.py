"""Cost model: analytic phase times, the SimEngine replica it fills in, and the profiling fits
(least squares recovers known parameters from noisy measurements)."""

from __future__ import annotations

import numpy as np
import pytest
from harness.fit import fit_decode, fit_linear, measure_host, refine

from sluice.sim.cost_model import DEVICES, MODELS, CostModel, Efficiency, trainer_cost
from sluice.sim.engine import LengthModel

LENGTHS = LengthModel(median=500, prompt_sigma=0.5, sample_sigma=0.5)


@pytest.mark.parametrize(("decode_s", "knee"), [(0.02, 32.0), (0.0113, 150.0), (0.5, 4.0)])
def test_fit_decode_recovers_the_knee_model(decode_s, knee):
    rng = np.random.default_rng(0)
    batches = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512] * 3, dtype=float)
    truth = decode_s * np.maximum(1.0, batches / knee)
    fit = fit_decode(batches, truth * (1 + 0.02 * rng.standard_normal(len(batches))))
    assert fit.decode_s == pytest.approx(decode_s, rel=0.03)
    assert fit.knee == pytest.approx(knee, rel=0.05)
    assert fit.predict(2 * knee) == pytest.approx(2 * decode_s, rel=0.05)


def test_fit_linear_recovers_overhead_and_slope():
    rng = np.random.default_rng(1)
    tokens = rng.integers(500, 9000, 40).astype(float)
    seconds = 0.05 + 3e-4 * tokens + 0.002 * rng.standard_normal(40)
    fit = fit_linear(tokens, seconds)
    assert fit.intercept == pytest.approx(0.05, abs=0.005) and fit.slope == pytest.approx(3e-4, rel=0.02)


def test_fits_refuse_unusable_input():
    with pytest.raises(ValueError, match="distinct"):
        fit_linear([5, 5, 5], [1.0, 1.1, 0.9])
    with pytest.raises(ValueError, match="equally long"):
        fit_decode([1, 2, 3], [0.1, 0.2])


def decode_iteration_s(cost: CostModel, batch: int, context: float, tp: int = 1) -> float:
    """The cost model's decode iteration at running batch ``batch`` (docs/planner.md):
    ``max(decode_s, batch · per_seq_s)``, the weights read once or every sequence's own work."""
    return max(cost.decode_s(tp), batch * cost.decode_per_seq_s(context, tp))


def test_refine_reproduces_the_measurement_and_extrapolates_by_device_count():
    cost = CostModel(MODELS["qwen2.5-7b"], DEVICES["H100"])
    decode = fit_decode([1, 8, 64, 128, 256, 512], [0.03, 0.03, 0.03, 0.048, 0.096, 0.192])
    train = fit_linear([1000, 4000, 8000], [0.1 + 1000 * 5e-5, 0.1 + 4000 * 5e-5, 0.1 + 8000 * 5e-5])
    refined = refine(cost, decode=decode, context=600, train=train, train_devices=2)
    assert refined.decode_s() == pytest.approx(decode.decode_s, rel=1e-6)
    assert decode_iteration_s(refined, 512, 600) == pytest.approx(decode.predict(512), rel=1e-3)
    assert refined.train_token_s(2) == pytest.approx(5e-5, rel=1e-3)
    assert refined.train_token_s(4) == pytest.approx(2.5e-5, rel=1e-3)  # FLOPs split over devices
    assert refined.eff.microbatch_overhead_s == pytest.approx(0.1, rel=1e-3)


def test_engine_config_is_the_analytic_decode_curve():
    cost = CostModel(MODELS["qwen2.5-7b"], DEVICES["H100"])
    engine = cost.engine_config(2, LENGTHS, prompt_len=256)
    context = 256 + 0.5 * 500 * np.exp(0.25)
    assert engine.iteration_s(1) == pytest.approx(decode_iteration_s(cost, 1, context, 2))
    big = 4 * engine.knee
    assert engine.iteration_s(big) == pytest.approx(decode_iteration_s(cost, big, context, 2), rel=0.02)
    # weights-bound decode: H200's bandwidth makes the flat part faster than H100's, A100 slower
    h200 = CostModel(MODELS["qwen2.5-7b"], DEVICES["H200"], Efficiency(decode_overhead_s=0.0))
    h100 = CostModel(MODELS["qwen2.5-7b"], DEVICES["H100"], Efficiency(decode_overhead_s=0.0))
    assert h100.decode_s() / h200.decode_s() == pytest.approx(4.8 / 3.35)
    assert CostModel(MODELS["qwen2.5-7b"], DEVICES["A100"]).decode_s() > h100.decode_s()


def test_memory_limits_refuse_what_does_not_fit():
    big = CostModel(MODELS["qwen2.5-32b"], DEVICES["910B"])
    with pytest.raises(ValueError, match="does not fit"):
        big.engine_config(1, LENGTHS, prompt_len=256)  # 65 GB of weights on a 64 GB device
    assert big.engine_config(2, LENGTHS, prompt_len=256).max_running > 0
    with pytest.raises(ValueError, match="memory limit"):
        trainer_cost(big, 1, 4096)
    assert trainer_cost(big, 16, 4096).token_s == pytest.approx(big.train_token_s(16))


def test_measure_host_gives_positive_peaks():
    host = measure_host(seconds=0.05)
    assert host.peak_flops > 1e8 and host.mem_bw > 1e8

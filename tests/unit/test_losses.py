"""ppo_clip_loss against a per-token plain-Python reference (floats and loops)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from loss_cases import run_loss
from sluice.trainer.losses import ppo_clip_loss

torch.set_num_threads(1)


def reference(
    logp, prox, behav, adv, mask, normaliser, lo=0.2, hi=0.2, cap=None, mode="clamp"
) -> tuple[float, int, list[float]]:
    """Loss, clipped-token count and d loss / d logp per token."""
    total, clipped, grads = 0.0, 0, []
    for lp, px, bh, a, m in zip(logp, prox, behav, adv, mask, strict=True):
        if not m:
            grads.append(0.0)
            continue
        r = math.exp(lp - px)
        w = math.exp(px - bh)
        if cap is not None and w > cap:
            w = cap if mode == "clamp" else 0.0
        unclipped = r * a
        clipped_obj = min(max(r, 1 - lo), 1 + hi) * a
        total += -w * min(unclipped, clipped_obj)
        is_clipped = clipped_obj < unclipped
        clipped += is_clipped
        grads.append(0.0 if is_clipped else -w * a * r / normaliser)
    return total / normaliser, clipped, grads


def random_inputs(n: int, seed: int, decoupled: bool) -> dict:
    rng = random.Random(seed)
    prox = [rng.uniform(-3, -0.1) for _ in range(n)]
    # log-ratios spread over [-0.6, 0.6] so tokens clip on both sides, with both advantage signs.
    logp = [p + rng.uniform(-0.6, 0.6) for p in prox]
    behav = [p + rng.uniform(-0.5, 0.5) for p in prox] if decoupled else list(prox)
    adv = [rng.uniform(-2, 2) for _ in range(n)]
    mask = [rng.random() < 0.8 for _ in range(n)]
    return dict(logp=logp, prox=prox, behav=behav, adv=adv, mask=mask)


def run(d: dict, normaliser: float, **kw):
    return run_loss(ppo_clip_loss, d, normaliser, **kw)


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("lo,hi", [(0.2, 0.2), (0.1, 0.28)])
def test_matches_reference(decoupled: bool, lo: float, hi: float) -> None:
    d = random_inputs(200, seed=3, decoupled=decoupled)
    out, grad = run(d, 250.0, clip_low=lo, clip_high=hi)
    want, clipped, want_grad = reference(d["logp"], d["prox"], d["behav"], d["adv"], d["mask"], 250.0, lo, hi)
    assert out.loss.item() == pytest.approx(want, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)
    assert out.stats["clipped_tokens"] == clipped
    assert out.stats["tokens"] == sum(d["mask"])
    # Both sides of the clip and both advantage signs are exercised.
    sides = {(a > 0, lp - p > 0) for lp, p, a in zip(d["logp"], d["prox"], d["adv"], strict=True)}
    assert len(sides) == 4 and clipped > 10


def test_prox_equals_behav_is_standard_ppo_clip() -> None:
    d = random_inputs(64, seed=5, decoupled=False)
    out, _ = run(d, 64.0)
    logp, old = torch.tensor(d["logp"], dtype=torch.float64), torch.tensor(d["prox"], dtype=torch.float64)
    adv, mask = torch.tensor(d["adv"], dtype=torch.float64), torch.tensor(d["mask"], dtype=torch.float64)
    ratio = torch.exp(logp - old)
    ppo = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
    assert out.loss.item() == pytest.approx(((ppo * mask).sum() / 64.0).item(), abs=1e-12)
    assert out.stats["behav_weight_sum"] == pytest.approx(sum(d["mask"]))


def test_decoupled_weight_is_applied_and_capped() -> None:
    d = dict(logp=[-1.0, -1.0], prox=[-1.0, -1.0], behav=[-1.5, -0.9], adv=[1.0, -1.0], mask=[True, True])
    out, _ = run(d, 2.0)
    w = [math.exp(0.5), math.exp(-0.1)]
    assert out.loss.item() == pytest.approx((-w[0] * 1.0 + w[1] * 1.0) / 2.0, abs=1e-12)
    out, _ = run(d, 2.0, behav_weight_cap=1.2)
    assert out.loss.item() == pytest.approx((-1.2 + w[1]) / 2.0, abs=1e-12)
    assert out.stats["capped_tokens"] == 1
    out, _ = run(d, 2.0, behav_weight_cap=1.2, behav_cap_mode="mask")
    assert out.loss.item() == pytest.approx(w[1] / 2.0, abs=1e-12)
    for cap, mode in [(1.5, "clamp"), (1.5, "mask")]:
        big = random_inputs(100, seed=9, decoupled=True)
        out, grad = run(big, 90.0, behav_weight_cap=cap, behav_cap_mode=mode)
        want, _, want_grad = reference(
            big["logp"], big["prox"], big["behav"], big["adv"], big["mask"], 90.0, cap=cap, mode=mode
        )
        assert out.loss.item() == pytest.approx(want, abs=1e-12)
        assert grad == pytest.approx(want_grad, abs=1e-12)


def test_losses_add_across_splits_and_masked_inf_is_harmless() -> None:
    d = random_inputs(30, seed=11, decoupled=True)
    d["behav"][0], d["mask"][0] = -1e4, False  # huge weight on a masked token
    full, full_grad = run(d, 30.0)
    parts = [{k: v[:12] for k, v in d.items()}, {k: v[12:] for k, v in d.items()}]
    outs = [run(p, 30.0) for p in parts]
    assert sum(o.loss.item() for o, _ in outs) == pytest.approx(full.loss.item(), abs=1e-12)
    assert outs[0][1] + outs[1][1] == pytest.approx(full_grad, abs=1e-12)
    assert all(math.isfinite(g) for g in full_grad) and math.isfinite(full.stats["kl_behav_sum"])


def test_rejects_bad_inputs() -> None:
    d = random_inputs(4, seed=0, decoupled=False)
    with pytest.raises(ValueError):
        run(d, 0.0)
    d["adv"] = d["adv"][:3]
    with pytest.raises(ValueError):
        run(d, 4.0)

"""Dual clip, TIS, CISPO, TOPR, GSPO and the aggregation modes against plain-Python references.

Inputs are several sequences of unequal lengths with masks, both advantage signs and ratios on
both sides of every clip. The references loop over floats: per-token loss and d loss / d logp,
then the aggregation mode, then the step-wide normaliser.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from loss_cases import run_loss
from sluice.api.types import LossInputs
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.losses import AGG_MODES, POLICY_LOSSES, agg_normaliser, gspo_loss, ppo_clip_loss

torch.set_num_threads(1)

LENGTHS = [1, 7, 3, 12, 5, 2, 9]


def make(seed: int, lengths=LENGTHS, decoupled: bool = True, seq_adv: bool = False) -> dict:
    rng = random.Random(seed)
    d: dict = {k: [] for k in ("logp", "prox", "behav", "adv", "mask")}
    for n in lengths:
        a_seq = rng.uniform(-2, 2)
        for _ in range(n):
            p = rng.uniform(-3, -0.1)
            d["prox"].append(p)
            d["logp"].append(p + rng.uniform(-0.6, 0.6))
            d["behav"].append(p + rng.uniform(-0.4, 0.4) if decoupled else p)
            d["adv"].append(a_seq if seq_adv else rng.uniform(-2, 2))
            d["mask"].append(rng.random() < 0.8)
    d["mask"][len(d["mask"]) - lengths[-1] :] = [False] * lengths[-1]  # a fully masked sequence
    d["lengths"] = list(lengths)
    return d


run = run_loss


def seqs(d: dict) -> list[list[int]]:
    out, start = [], 0
    for n in d["lengths"]:
        out.append(list(range(start, start + n)))
        start += n
    return out


def ref_weights(d: dict, cap=None, mode="cap", level="token") -> list[float]:
    w = [0.0] * len(d["logp"])
    for s in seqs(d):
        if level == "sequence":
            log_w = sum(d["prox"][t] - d["behav"][t] for t in s if d["mask"][t])
            for t in s:
                w[t] = math.exp(log_w)
        else:
            for t in s:
                w[t] = math.exp(d["prox"][t] - d["behav"][t]) if d["mask"][t] else 1.0
    if cap is not None:
        w = [x if x <= cap else (cap if mode == "cap" else 0.0) for x in w]
    return w


def ref_aggregate(d: dict, values: list[float], grads: list[float], mode: str, normaliser: float):
    """Loss and per-token gradient after aggregation (masked tokens contribute nothing)."""
    loss, g = 0.0, [0.0] * len(values)
    for s in seqs(d):
        n = max(sum(d["mask"][t] for t in s), 1) if mode == "seq-mean-token-mean" else 1
        for t in s:
            if d["mask"][t]:
                loss += values[t] / n / normaliser
                g[t] = grads[t] / n / normaliser
    return loss, g


def ref_ppo(d, w, lo=0.2, hi=0.2, c=None):
    vals, grads, dual = [], [], 0
    for lp, px, a, wt in zip(d["logp"], d["prox"], d["adv"], w, strict=True):
        r = math.exp(lp - px)
        un, cl = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
        pg, g = (un, -a * r) if un >= cl else (cl, 0.0)
        if c is not None and a < 0 and pg > -c * a:
            pg, g = -c * a, 0.0
            dual += 1
        vals.append(wt * pg)
        grads.append(wt * g)
    return vals, grads, dual


def ref_cispo(d, w, lo=None, hi=0.2):
    """MiniMax-M1 (arXiv 2506.13585) §3.1: the IS weight is clipped from above only (their
    ε_low^IS is set large, "no lower bound"); ``lo`` adds the optional lower bound."""
    vals, grads = [], []
    for lp, px, a, wt in zip(d["logp"], d["prox"], d["adv"], w, strict=True):
        c = min(math.exp(lp - px), 1 + hi) if lo is None else min(max(math.exp(lp - px), 1 - lo), 1 + hi)
        vals.append(-wt * c * a * lp)
        grads.append(-wt * c * a)
    return vals, grads


def ref_topr(d, w):
    vals, grads = [], []
    for lp, px, a, wt in zip(d["logp"], d["prox"], d["adv"], w, strict=True):
        c = 1.0 if a > 0 else min(max(math.exp(lp - px), 0.0), 1.0)
        vals.append(-wt * c * a * lp)
        grads.append(-wt * c * a)
    return vals, grads


def ref_gspo(d, w, lo=0.2, hi=0.2):
    vals, grads = [0.0] * len(d["logp"]), [0.0] * len(d["logp"])
    for s in seqs(d):
        live = [t for t in s if d["mask"][t]]
        mean_log = sum(d["logp"][t] - d["prox"][t] for t in live) / max(len(live), 1)
        ratio = math.exp(mean_log)
        for t in s:
            a = d["adv"][t]
            un, cl = -a * ratio, -a * min(max(ratio, 1 - lo), 1 + hi)
            vals[t], grads[t] = (w[t] * un, -w[t] * a * ratio) if un >= cl else (w[t] * cl, 0.0)
    return vals, grads


CASES = {
    "ppo_clip": lambda d, w: ref_ppo(d, w)[:2],
    "cispo": ref_cispo,
    "topr": ref_topr,
    "gspo": ref_gspo,
}


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_loss_matches_reference(name: str, mode: str) -> None:
    d = make(seed=len(name) + len(mode))
    norm = agg_normaliser(mode, [[int(m) for m in d["mask"][s[0] : s[-1] + 1]] for s in seqs(d)])
    live = sum(1 for s in seqs(d) if any(d["mask"][t] for t in s))  # the last sequence is fully masked
    assert norm == (sum(d["mask"]) if mode == "token-mean" else live) and live < len(LENGTHS)
    out, grad = run(POLICY_LOSSES[name], d, norm, agg_mode=mode)
    want, want_grad = ref_aggregate(d, *CASES[name](d, ref_weights(d)), mode, norm)
    assert out.loss.item() == pytest.approx(want, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)
    assert out.stats["tokens"] == sum(d["mask"])
    if name != "topr":
        assert out.stats["clipped_tokens"] > 0


def test_ppo_dual_clip_fires_on_negative_advantages_only() -> None:
    d = make(seed=4)
    norm = float(sum(d["mask"]))
    out, grad = run(ppo_clip_loss, d, norm, dual_clip_c=1.5, clip_low=0.1, clip_high=0.3)
    vals, grads, dual = ref_ppo(d, ref_weights(d), lo=0.1, hi=0.3, c=1.5)
    masked_dual = sum(
        1
        for lp, px, a, m in zip(d["logp"], d["prox"], d["adv"], d["mask"], strict=True)
        if m and a < 0 and math.exp(lp - px) * -a > -1.5 * a
    )
    want, want_grad = ref_aggregate(d, vals, grads, "token-mean", norm)
    assert out.loss.item() == pytest.approx(want, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)
    assert dual > 0 and out.stats["dual_clipped_tokens"] == masked_dual > 0
    without, _ = run(ppo_clip_loss, d, norm, clip_low=0.1, clip_high=0.3)
    assert out.loss.item() < without.loss.item()  # the bound only ever lowers the loss
    with pytest.raises(ValueError):
        run(ppo_clip_loss, d, norm, dual_clip_c=1.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["cap", "mask"])
@pytest.mark.parametrize("name", ["ppo_clip", "cispo", "gspo"])
def test_truncated_importance_sampling(level: str, mode: str, name: str) -> None:
    d = make(seed=6)
    cap = 1.1
    norm = float(sum(d["mask"]))
    kw = dict(behav_weight_cap=cap, behav_cap_mode=mode, behav_weight_level=level, agg_mode="token-mean")
    out, grad = run(POLICY_LOSSES[name], d, norm, **kw)
    raw = ref_weights(d, level=level)
    w = ref_weights(d, cap, mode, level)
    want, want_grad = ref_aggregate(d, *CASES[name](d, w), "token-mean", norm)
    assert out.loss.item() == pytest.approx(want, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)
    capped = sum(1 for x, m in zip(raw, d["mask"], strict=True) if m and x > cap)
    assert out.stats["capped_tokens"] == capped > 0
    assert out.stats["behav_weight_sum"] == pytest.approx(sum(x for x, m in zip(w, d["mask"], strict=True) if m))


def test_cap_and_mask_differ_only_on_capped_tokens() -> None:
    d = dict(logp=[-1.0, -1.0], prox=[-1.0, -1.0], behav=[-1.5, -0.9], adv=[1.0, -1.0], mask=[True, True], lengths=[2])
    w = [math.exp(0.5), math.exp(-0.1)]
    cap, _ = run(ppo_clip_loss, d, 2.0, behav_weight_cap=1.2, behav_cap_mode="cap")
    mask, _ = run(ppo_clip_loss, d, 2.0, behav_weight_cap=1.2, behav_cap_mode="mask")
    assert cap.loss.item() == pytest.approx((-1.2 + w[1]) / 2.0, abs=1e-12)
    assert mask.loss.item() == pytest.approx(w[1] / 2.0, abs=1e-12)
    seq, _ = run(ppo_clip_loss, d, 2.0, behav_weight_cap=1.2, behav_cap_mode="mask", behav_weight_level="sequence")
    assert seq.loss.item() == 0.0 and seq.stats["capped_tokens"] == 2  # exp(0.4) > 1.2: whole sequence dropped


def test_cispo_has_no_lower_bound_on_a_stale_token() -> None:
    """A token the policy has moved away from (u = π_θ / π_behav = 0.1, A < 0) keeps the weight
    0.1: a lower bound (0.8 before the fix) kept pushing stale negative tokens down at nearly full
    strength, and off-policy CISPO collapsed (η = 4: 1.8 % held-out accuracy; 70.8 % after)."""
    lp = math.log(0.1) - 1.0
    d = dict(logp=[lp], prox=[-1.0], behav=[-1.0], adv=[-1.0], mask=[True], lengths=[1])
    out, grad = run(POLICY_LOSSES["cispo"], d, 1.0, clip_high=0.2)
    assert grad == pytest.approx([0.1], abs=1e-12)  # d/dlogp of -sg(u)·A·logp = -u·A
    assert out.stats["clipped_tokens"] == 0
    bounded, grad = run(POLICY_LOSSES["cispo"], d, 1.0, clip_low=0.2, clip_high=0.2)
    assert grad == pytest.approx([0.8], abs=1e-12) and bounded.stats["clipped_tokens"] == 1
    assert ref_cispo(d, [1.0], lo=0.2)[1] == pytest.approx([0.8])
    inputs = LossInputs(
        logp=torch.tensor([lp], dtype=torch.float64, requires_grad=True),
        prox_logp=torch.tensor([-1.0], dtype=torch.float64),
        behav_logp=torch.tensor([-1.0], dtype=torch.float64),
        advantages=torch.tensor([-1.0], dtype=torch.float64),
        mask=torch.tensor([True]),
        normaliser=1.0,
    )
    GRPOAlgorithm(policy_loss="cispo", clip_low=0.2).loss(inputs).loss.backward()  # the trainer's path
    assert inputs.logp.grad is not None and inputs.logp.grad.tolist() == pytest.approx([0.1], abs=1e-12)


def test_gspo_equals_sequence_objective_of_the_paper() -> None:
    """Constant advantage per sequence + seq-mean-token-mean: mean_i -min(s_i A_i, clip(s_i) A_i)."""
    d = make(seed=8, decoupled=False, seq_adv=True)
    live_seqs = [s for s in seqs(d) if any(d["mask"][t] for t in s)]
    norm = float(len(live_seqs))
    out, grad = run(gspo_loss, d, norm, clip_low=0.05, clip_high=0.05)
    loss, want_grad = 0.0, [0.0] * len(d["logp"])
    for s in live_seqs:
        live = [t for t in s if d["mask"][t]]
        ratio = math.exp(sum(d["logp"][t] - d["prox"][t] for t in live) / len(live))
        a = d["adv"][s[0]]
        unclipped, clipped = ratio * a, min(max(ratio, 0.95), 1.05) * a
        loss -= min(unclipped, clipped) / norm
        if unclipped <= clipped:  # d s_i / d logp_t = s_i / |y_i|
            for t in live:
                want_grad[t] = -a * ratio / len(live) / norm
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)
    ratios = [out.stats["ratio_sum"]]
    assert out.stats["clipped_tokens"] > 0 and math.isfinite(ratios[0])


def _slice(d: dict, first: int, last: int) -> dict:
    s = seqs(d)
    lo, hi = s[first][0], s[last - 1][-1] + 1
    part = {k: d[k][lo:hi] for k in ("logp", "prox", "behav", "adv", "mask")}
    part["lengths"] = d["lengths"][first:last]
    return part


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_unequal_micro_batches_accumulate_to_the_full_batch(name: str, mode: str) -> None:
    """Micro-batches summed with normaliser 1, then scaled once by the step's normaliser
    (as the trainer does), equal one full-batch pass with that normaliser."""
    d = make(seed=10)
    norm = agg_normaliser(mode, [[int(m) for m in d["mask"][s[0] : s[-1] + 1]] for s in seqs(d)])
    full, full_grad = run(POLICY_LOSSES[name], d, norm, agg_mode=mode)
    total, grads = 0.0, []
    for first, last in [(0, 1), (1, 4), (4, 5), (5, 7)]:  # 1, 22, 5, 11 tokens
        out, g = run(POLICY_LOSSES[name], _slice(d, first, last), 1.0, agg_mode=mode)
        total += out.loss.item()
        grads += g
    assert total / norm == pytest.approx(full.loss.item(), abs=1e-12)
    assert [g / norm for g in grads] == pytest.approx(full_grad, abs=1e-12)


def test_sequence_ops_need_boundaries() -> None:
    d = make(seed=1)
    d_no = dict(d)
    logp = torch.tensor(d_no["logp"], dtype=torch.float64)
    inputs = LossInputs(
        logp=logp,
        prox_logp=logp,
        behav_logp=logp,
        advantages=logp,
        mask=torch.ones_like(logp, dtype=torch.bool),
        normaliser=1.0,
    )
    with pytest.raises(ValueError, match="seq_lengths"):
        gspo_loss(inputs)
    with pytest.raises(ValueError, match="seq_lengths"):
        ppo_clip_loss(inputs, agg_mode="seq-mean-token-mean")
    with pytest.raises(ValueError):
        agg_normaliser("nope", [[1]])


@pytest.mark.parametrize("loss,mode", [("ppo_clip", "seq-mean-token-mean"), ("gspo", "seq-mean-token-sum")])
def test_engine_streams_sequence_modes_like_one_pass(loss: str, mode: str) -> None:
    """Through HFTrainEngine (seq_lengths from ``_loss_inputs``, length-bucketed parts): micro-batches
    with normaliser 1 scaled once by ``algorithm.normaliser`` equal one pass with that normaliser."""
    from sluice.api.types import MicroBatch, Sample
    from sluice.engines.hf_train import HFTrainEngine
    from sluice.trainer.step import run_step
    from tiny import VOCAB, tiny_llama

    rng = random.Random(0)
    samples = []
    for i in range(6):
        n = rng.randint(1, 9)
        samples.append(
            Sample(
                uid=f"s{i}",
                group_id=i // 3,
                prompt_ids=tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))),
                response_ids=tuple(rng.randrange(1, VOCAB) for _ in range(n)),
                behav_logprobs=tuple(-rng.uniform(2.5, 4.0) for _ in range(n)),
                token_versions=(0,) * n,
                loss_mask=tuple(int(rng.random() < 0.85) for _ in range(n)),
                reward=rng.choice([0.0, 1.0, 0.5]),
            )
        )
    algo = GRPOAlgorithm(policy_loss=loss, loss_agg_mode=mode)
    engine = HFTrainEngine(tiny_llama(0), lr=0.0, grad_clip=None, padded_token_budget=24)
    prox = [[x + rng.uniform(-0.3, 0.3) for x in row] for row in engine.logprobs(samples, 1.0)]
    adv = algo.advantages(samples)

    def batch(idx: range, normaliser: float) -> MicroBatch:
        return MicroBatch(
            samples=tuple(samples[i] for i in idx),
            advantages=tuple(tuple(adv[i]) for i in idx),
            prox_logprobs=tuple(tuple(prox[i]) for i in idx),
            normaliser=normaliser,
        )

    norm = algo.normaliser(samples)
    assert norm == sum(1 for s in samples if sum(s.loss_mask))
    full = run_step(engine, [batch(range(6), norm)], algo, normaliser=1.0)
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    engine.begin_step()
    for idx in (range(0, 1), range(1, 4), range(4, 6)):
        engine.accumulate(batch(idx, 1.0), algo)
    streamed = engine.finish_step(grad_scale=1.0 / norm)
    for name, p in engine.model.named_parameters():
        assert torch.allclose(p.grad, grads[name], atol=1e-6), name
    assert streamed["loss"] == pytest.approx(full["loss"], abs=1e-6) and full["grad_norm"] > 0


def test_off_policy_metrics_against_the_reference_formulas():
    """Issue 18's instruments: the behaviour weight w = π_prox / π_behav (mean, ESS fraction
    (Σw)² / (N Σw²), tails beyond ×/÷ 2) and the fraction of tokens whose ratio lies outside the
    clip range against the proximal and against the behaviour policy, token by token."""
    from sluice.trainer.losses.common import off_policy_metrics

    logp = torch.tensor([-1.0, -1.0, -2.0, -0.5, -3.0, -1.0])
    prox = torch.tensor([-1.1, -1.0, -1.5, -0.5, -3.0, -9.0])
    behav = torch.tensor([-1.0, -2.0, -1.0, -0.2, -4.0, -1.0])
    mask = torch.tensor([True, True, True, True, True, False])
    inputs = LossInputs(logp, prox, behav, torch.ones(6), mask, normaliser=5.0)
    stats = ppo_clip_loss(inputs, clip_low=0.2, clip_high=0.2).stats
    metrics = off_policy_metrics(stats)

    w = [math.exp(p - b) for p, b, m in zip(prox.tolist(), behav.tolist(), mask.tolist(), strict=True) if m]
    to_prox = [math.exp(lp - p) for lp, p, m in zip(logp.tolist(), prox.tolist(), mask.tolist(), strict=True) if m]
    to_behav = [math.exp(lp - b) for lp, b, m in zip(logp.tolist(), behav.tolist(), mask.tolist(), strict=True) if m]
    n = len(w)
    assert metrics["behav_weight_mean"] == pytest.approx(sum(w) / n)
    assert metrics["behav_ess_fraction"] == pytest.approx(sum(w) ** 2 / (n * sum(x * x for x in w)))
    assert metrics["behav_weight_low_fraction"] == pytest.approx(sum(x < 0.5 for x in w) / n)
    assert metrics["behav_weight_high_fraction"] == pytest.approx(sum(x > 2 for x in w) / n)
    assert metrics["clip_outside_prox"] == pytest.approx(sum(not 0.8 <= r <= 1.2 for r in to_prox) / n)
    assert metrics["clip_ratio"] == pytest.approx(stats["clipped_tokens"] / n)  # verl's pg_clipfrac
    assert metrics["clip_outside_behav"] == pytest.approx(sum(not 0.8 <= r <= 1.2 for r in to_behav) / n)


def test_with_one_update_per_step_the_decoupled_clip_never_binds():
    """Why decoupled PPO loses at high staleness here (issue 18): with ``prox_logprobs:
    recompute`` and one update per step (the default: ``ppo_mini_batches: 1``), the proximal
    policy *is* the policy being updated, so π_θ / π_prox = 1 on every token and the trust region
    is void; only the (uncapped) behaviour weight remains. PPO-clip against the behaviour policy
    clips the same tokens' gradients."""
    from sluice.trainer.losses.common import off_policy_metrics

    generator = torch.Generator().manual_seed(0)
    behav = -torch.rand(64, generator=generator) * 3
    logp = behav + torch.randn(64, generator=generator)  # the policy moved 8 versions since sampling
    adv = torch.randn(64, generator=generator)
    mask = torch.ones(64, dtype=torch.bool)
    decoupled = off_policy_metrics(ppo_clip_loss(LossInputs(logp, logp, behav, adv, mask, 64.0)).stats)
    assert decoupled["clip_outside_prox"] == 0.0 and decoupled["clip_outside_behav"] > 0.5
    assert decoupled["behav_ess_fraction"] < 0.5  # the weight alone carries the correction

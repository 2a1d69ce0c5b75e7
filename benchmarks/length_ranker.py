"""Output-length ranker (StreamRL Table 4): recall of the true top-20 % longest on unseen prompts.

Real lengths, not a model of them: the embedded default's warm-started base model (built and
cached on first use) samples ``--group`` responses at temperature 1 (the rollout setting) for
``--train`` training prompts of the reverse-digits task and for its held-out prompts, which no
training row contains. ``OnlineLengthRanker`` observes the training (prompt, length) pairs in
arrival order; after each checkpoint it ranks the held-out samples, and the table reports
recall@20 % = |predicted top 20 % ∩ true top 20 %| / |true top 20 %| (ties broken at random,
averaged over ``--tie-seeds``), beside random ranking (0.2 in expectation), ranking by prompt
length (this task's answer is as long as its prompt: a strong hand-made baseline), and a
sample-noise reference: each sample predicted by the mean length of the *other* samples of its prompt.

    .venv/bin/python benchmarks/length_ranker.py [--train 1024] [--group 4] [--eval 500]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from sluice.api import GenerationRequest, SamplingParams
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm, load_tokenizer
from sluice.rollout.length_ranker import OnlineLengthRanker, top_share_recall
from sluice.rollout.single_turn import sample_seed
from sluice.tasks import TASKS
from sluice.tasks.base_model import ensure_base_model
from sluice.tasks.spec import eval_rows, generate_rows

TARGET = 0.6
STREAMRL_RECALL = 0.87


def _lengths(engine: HFInferenceEngine, prompts: list[tuple[int, ...]], group: int, params: SamplingParams, salt: int):
    """``[prompts][group]`` response lengths sampled by the real engine."""
    futures = [
        [
            engine.submit(GenerationRequest(f"{salt}-{p}-{k}", ids, params, sample_seed(salt, p, k)))
            for k in range(group)
        ]
        for p, ids in enumerate(prompts)
    ]
    while engine.has_work():
        engine.step()
    return [[len(f.result().token_ids) for f in row] for row in futures]


def _recall(predicted: list[float], actual: list[int], seeds: int) -> float:
    return statistics.fmean(top_share_recall(predicted, actual, 0.2, seed=s) for s in range(seeds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=1024, help="training prompts observed online")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--eval", type=int, default=500, help="held-out (unseen) prompts")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--tie-seeds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/length_ranker.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = TASKS["reverse_digits"]
    model_dir = ensure_base_model(task, ".cache/sluice", seed=0, eval_count=500)
    tokenizer = load_tokenizer(model_dir)
    held_out = eval_rows(task, args.eval)
    train = generate_rows(task, args.train, seed=1, exclude={r["prompt"] for r in held_out})
    encode = lambda rows: [tuple(tokenizer(r["prompt"])["input_ids"]) for r in rows]  # noqa: E731
    train_ids, test_ids = encode(train), encode(held_out)
    params = SamplingParams(task.max_new_tokens, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
    engine = HFInferenceEngine(load_causal_lm(model_dir), max_batch=args.max_batch)
    started = time.perf_counter()
    train_len = _lengths(engine, train_ids, args.group, params, salt=1)
    test_len = _lengths(engine, test_ids, args.group, params, salt=2)
    generate_s = time.perf_counter() - started

    actual = [n for row in test_len for n in row]
    per_sample = lambda per_prompt: [v for v in per_prompt for _ in range(args.group)]  # noqa: E731
    rng = random.Random(0)
    rows = [
        ("random", 0, _recall([rng.random() for _ in actual], actual, args.tie_seeds)),
        ("prompt length", 0, _recall(per_sample([float(len(p)) for p in test_ids]), actual, args.tie_seeds)),
    ]
    ranker = OnlineLengthRanker()
    checkpoints = sorted({c for c in (0, 16, 64, 256, args.train) if c <= args.train})
    seen = 0
    for checkpoint in checkpoints:
        for ids, lengths in zip(train_ids[seen:checkpoint], train_len[seen:checkpoint], strict=True):
            for n in lengths:
                ranker.observe(ids, n)
        seen = checkpoint
        rows.append(("OnlineLengthRanker", seen, _recall(per_sample(ranker.predict(test_ids)), actual, args.tie_seeds)))
    others = [(sum(row) - n) / (len(row) - 1) for row in test_len for n in row] if args.group > 1 else actual
    rows.append(("mean length of the same prompt's other samples", 0, _recall(others, actual, args.tie_seeds)))

    lengths = sorted(actual)
    print(
        f"real lengths from the base model ({len(train_ids) + len(test_ids)} prompts × {args.group}, "
        f"{generate_s:.1f} s); held-out p50 = {lengths[len(lengths) // 2]}, p80 = {lengths[int(0.8 * len(lengths))]}, "
        f"max = {lengths[-1]} tokens"
    )
    print(f"{'ranker':<46} {'prompts seen':>12} {'recall@20%':>10}")
    for name, seen, recall in rows:
        print(f"{name:<46} {seen:>12} {recall:>10.3f}")
    final = rows[-2][2]
    verdict = "met" if final >= TARGET else "NOT met"
    print(f"target >= {TARGET}: {verdict} ({final:.3f}); StreamRL reports {STREAMRL_RECALL}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "args": vars(args),
        "lengths_from": "real samples of the warm-started base model (temperature 1)",
        "generate_s": generate_s,
        "rows": [{"ranker": n, "prompts_seen": s, "recall_at_20": r} for n, s, r in rows],
        "target": TARGET,
        "streamrl_recall": STREAMRL_RECALL,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

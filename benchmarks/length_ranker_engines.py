"""Length rankers driving LPT and long-tail routing on real engines (issue 45 item 4).

``benchmarks/length_ranker.py --workload hidden`` measures the rankers' recall on the hidden
length rule and replays their plans through a cost model. This script runs the plans on real
engines: ``--replicas`` built-in HF engines (``HFInferenceEngine``, each in its own Ray actor,
``EngineHost``, one torch thread each, so each replica computes on a core of its own) behind the
real ``LLMProxy``, exactly as ``sluice train`` with ``resources.rollout.replica_actors`` routes.

The lengths follow the hidden rule (``length_ranker.py``'s workload): each request asks for its
rule length as ``max_new_tokens`` with no stop token, so the engine decodes exactly that many
tokens (checked for every completion) on a tiny random Llama whose vocabulary holds the
workload's token ids; the time is the engines' real decoding, the lengths are the rule's (a
policy trained to follow the rule would produce the same lengths; no such policy exists here).

Each ranker first observes ``--train`` prompts × ``--group`` samples of the rule in arrival order
(as a run's ranker learns from finished responses), then is frozen, so every variant of a round
sees the same predictions. One step: ``--prompts`` held-out prompts × ``--group`` samples, all
submitted at once in a shuffled order; its wall time until the last completion is the step's
generation time. Variants, alternated within each of ``--repeats`` rounds:

- ``fifo``: no ranker; each replica serves its requests in arrival order at ``--slots``;
- ``lpt <ranker>``: ``fleet.lpt`` (the proxy holds the requests and gives each free slot to the
  longest predicted);
- ``long-tail <ranker>``: ``fleet.long_tail_replicas: 1`` beside LPT (StreamRL's skewness-aware
  dispatch, ``LongTailSplit``): the requests predicted in the top ``--tail-share`` go to one
  replica of their own, at most ``--tail-batch`` running. The default share, 0.12, gives that
  replica about half the step's tokens (the rule's top 12 % of samples hold 48 % of them; its top
  20 %, the default ``fleet.long_tail_share``, 64 %, more than one replica of two can carry);

for the rankers ``ridge`` (``OnlineLengthRanker``), ``model`` (``SequenceLengthRanker``) and
``oracle`` (each prompt's mean true length: the best any prompt-level ranker can do).

    flock /tmp/bench.lock .venv/bin/python benchmarks/length_ranker_engines.py \\
        --out benchmarks/results/length_ranker_engines.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from length_ranker import RANKERS, _hidden_rule_lengths, _recall

from sluice.api import GenerationRequest, SamplingParams
from sluice.rollout.proxy import LLMProxy
from sluice.rollout.replicas import RayReplica, start_engine_actors
from sluice.rollout.skew_dispatch import LongTailSplit

VOCAB_CHARS = 252  # + 4 special tokens: ids 0-255 hold the workload's token ids (below 200)


class Frozen:
    """A trained ranker that no longer learns: every variant of a round sees the same predictions."""

    def __init__(self, predict: object) -> None:
        self._predict = predict

    def predict(self, prompts: Sequence[Sequence[int]]) -> list[float]:
        return self._predict(prompts)  # type: ignore[operator]

    def observe(self, prompt_ids: Sequence[int], length: int) -> None:
        pass


class Oracle:
    """Each prompt's mean true length (no prompt-level ranker can know a sample's noise)."""

    def __init__(self, prompts: list[tuple[int, ...]], lengths: list[list[int]]) -> None:
        self.mean = {p: sum(ls) / len(ls) for p, ls in zip(prompts, lengths, strict=True)}

    def predict(self, prompts: Sequence[Sequence[int]]) -> list[float]:
        return [self.mean.get(tuple(p), 0.0) for p in prompts]

    def observe(self, prompt_ids: Sequence[int], length: int) -> None:
        pass


def save_model(folder: Path, max_len: int) -> Path:
    """A tiny random Llama whose vocabulary holds ids 0-255, saved like a user's model folder."""
    from dataclasses import replace

    from sluice.tasks.spec import TinyLlamaSpec
    from sluice.tasks.tiny_model import build_char_tokenizer, build_tiny_llama

    tokenizer = build_char_tokenizer("".join(chr(0x100 + i) for i in range(VOCAB_CHARS)))
    model = build_tiny_llama(replace(TinyLlamaSpec(), max_position_embeddings=max_len + 64), tokenizer, seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


async def run_step(proxy: LLMProxy, requests: list[GenerationRequest]) -> float:
    """Wall seconds until every request completed; each completion is checked to have its length."""
    started = time.perf_counter()
    completions = await asyncio.gather(*(proxy.generate(r) for r in requests))
    elapsed = time.perf_counter() - started
    for request, completion in zip(requests, completions, strict=True):
        if len(completion.token_ids) != request.params.max_new_tokens:
            raise AssertionError(
                f"{request.request_id}: {len(completion.token_ids)} tokens, asked for {request.params.max_new_tokens}"
            )
    return elapsed


def trained_rankers(data: dict, names: list[str]) -> tuple[dict[str, object], dict[str, float]]:
    """Each ranker after observing the training stream, frozen; and its recall@20 % on the step."""
    rankers: dict[str, object] = {}
    recall: dict[str, float] = {}
    actual = [n for row in data["test_len"] for n in row]
    group = len(data["test_len"][0])
    for name in names:
        ranker = RANKERS[name]()
        for ids, lengths in zip(data["train_ids"], data["train_len"], strict=True):
            for n in lengths:
                ranker.observe(ids, n)
        rankers[name] = Frozen(ranker.predict)
    rankers["oracle"] = Oracle(data["test_ids"], data["test_len"])
    for name, ranker in rankers.items():
        per_sample = [v for v in ranker.predict(data["test_ids"]) for _ in range(group)]  # type: ignore[attr-defined]
        recall[name] = _recall(per_sample, actual, 20)
    return rankers, recall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=1024, help="training prompts the rankers observe")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts in the measured step")
    parser.add_argument("--max-len", type=int, default=256, help="rule lengths are capped here")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--slots", type=int, default=16, help="running requests per replica (rollout.max_batch)")
    parser.add_argument("--tail-batch", type=int, default=16, help="running requests on the long-tail replica")
    parser.add_argument("--tail-share", type=float, default=0.12, help="predicted share of requests in the long tail")
    parser.add_argument("--rankers", nargs="+", default=["ridge", "model"], choices=sorted(RANKERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/length_ranker_engines.json"))
    args = parser.parse_args()
    args.eval = args.prompts
    data = _hidden_rule_lengths(args)
    data["test_len"] = [[min(n, args.max_len) for n in row] for row in data["test_len"]]
    rankers, recall = trained_rankers(data, args.rankers)

    import ray

    ray.init(num_cpus=args.replicas, include_dashboard=False, object_store_memory=200 << 20, log_to_driver=False)
    folder = save_model(Path(tempfile.mkdtemp(prefix="ranker_engines_")), args.max_len)
    handles = start_engine_actors(args.replicas, "hf", str(folder), max_batch=args.slots, options={}, threads=1)
    ray.get([h.heartbeat.remote() for h in handles])

    order = list(range(len(data["test_ids"]) * args.group))
    random.Random(0).shuffle(order)

    def requests(round_: int) -> list[GenerationRequest]:
        out = []
        for k in order:
            prompt, sample = divmod(k, args.group)
            length = data["test_len"][prompt][sample]
            params = SamplingParams(max_new_tokens=length, temperature=1.0, stop_token_ids=())
            out.append(GenerationRequest(f"r{round_}-{k}", data["test_ids"][prompt], params, seed=k))
        return out

    variants: list[tuple[str, object | None, bool]] = [("fifo", None, False)]
    for name in rankers:
        variants += [(f"lpt {name}", rankers[name], False), (f"long-tail {name}", rankers[name], True)]

    async def measure() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        await run_step(LLMProxy([RayReplica(h) for h in handles]), requests(-1)[: 4 * args.slots])  # warm-up
        for round_ in range(args.repeats):
            for name, ranker, tail in variants:
                proxy = LLMProxy(
                    [RayReplica(h) for h in handles],
                    length_predictor=ranker,  # type: ignore[arg-type]
                    slots=args.slots if ranker is not None else None,
                    long_tail=LongTailSplit(1, args.tail_batch, share=args.tail_share) if tail else None,
                )
                times[name].append(await run_step(proxy, requests(round_)))
                print(f"round {round_ + 1} {name:22s} {times[name][-1]:7.2f} s", flush=True)
        return times

    times = asyncio.run(measure())
    ray.shutdown()
    tokens = sum(sum(row) for row in data["test_len"])
    fifo = statistics.median(times["fifo"])
    print(f"\n{len(order)} requests, {tokens} tokens, {args.replicas} real HF replicas x {args.slots} slots")
    print(f"{'variant':24s} {'median s':>9s} {'vs fifo':>8s} {'recall@20%':>11s}  rounds")
    rows = []
    for name, _, _ in variants:
        med = statistics.median(times[name])
        ranker = name.split(" ", 1)[1] if " " in name else None
        row = {
            "variant": name,
            "median_s": med,
            "speedup": fifo / med,
            "recall": recall.get(ranker or ""),
            "rounds": times[name],
        }
        rows.append(row)
        rec = f"{row['recall']:.2f}" if row["recall"] is not None else ""
        print(f"{name:24s} {med:9.2f} {fifo / med:7.2f}x {rec:>11s}  {', '.join(f'{t:.2f}' for t in times[name])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "tokens": tokens, "rows": rows}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

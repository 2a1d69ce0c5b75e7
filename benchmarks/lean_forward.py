"""One decode forward of the engine's model through the library's ``forward`` against
``engines/lean_forward.py``'s (the same modules without transformers' per-call wrappers), at
several batch sizes, one torch thread, alternating, medians of 6 rounds of 100 forwards.

    flock /tmp/bench.lock .venv/bin/python benchmarks/lean_forward.py [--model DIR]

Default model: this tree's embedded base model of the default task (the guard's). Prints a table
and writes ``benchmarks/results/lean_forward.json``. The two paths' bits are equal
(``tests/unit/test_lean_forward.py``); this measures only their time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from sluice.engines.lean_forward import causal_lm_logits

ROOT = Path(__file__).resolve().parents[1]


def library(model, ids, mask, positions, cache, last_only):
    return model(
        input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
    ).logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="a causal LM folder (default: the embedded base model)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lean_forward.json")
    args = parser.parse_args()
    if args.model is None:
        from regression import tree_base_model

        args.model = tree_base_model()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    vocab, prompt = model.config.vocab_size, 20
    rows = []
    for batch in (8, 64, 256):
        ids = torch.randint(0, vocab, (batch, prompt))
        with torch.inference_mode():
            cache = model(input_ids=ids, use_cache=True).past_key_values
            last, positions = ids[:, -1:], torch.full((batch, 1), prompt)
            mask = torch.ones(batch, prompt + 1, dtype=torch.long)
            times: dict[str, list[float]] = {"library": [], "lean": []}
            for _ in range(6):
                for name, forward in (("library", library), ("lean", causal_lm_logits)):
                    start = time.perf_counter()
                    for _ in range(100):
                        forward(model, last, mask, positions, cache, False)
                        cache.crop(-1)
                    times[name].append((time.perf_counter() - start) / 100 * 1e3)
        lib_ms, lean_ms = statistics.median(times["library"]), statistics.median(times["lean"])
        rows.append({"rows": batch, "library_ms": lib_ms, "lean_ms": lean_ms, "ratio": lean_ms / lib_ms})
    print("| decode rows | library ms / forward | lean ms / forward | lean / library |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['library_ms']:.3f} | {r['lean_ms']:.3f} | {r['ratio']:.3f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(args.model), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Build what the example's warm start starts from: a BPE tokenizer with a chat template, a tiny
randomly initialised Qwen2 (a Hugging Face folder ``model.path`` loads) and ``sft.parquet``, the
demonstrations ``sluice sft`` trains it on.

    python examples/gsm8k_style/make_model.py --data examples/gsm8k_style/data --out examples/gsm8k_style/init
    .venv/bin/sluice sft examples/gsm8k_style/sft.yaml      # -> examples/gsm8k_style/runs/sft/final_model

``sft.parquet`` holds the train rows in verl's schema with ``extra_info.answer`` replaced by a
demonstration, deliberately imperfect so that RL has headroom: for three of the five templates
(``SHORTCUT``) 70 % of the demonstrations stop after the first step and box that intermediate
number, for the other two 30 % do (drawn once per row, seeded). The warm-started model can solve
every template (sampling finds the full solution often enough) but its greedy answer follows the
shortcut on most of them. The SFT itself is ``sluice sft`` (``sft.yaml``: the loss on the
solution and its ``<|im_end|>``, 8 epochs, the base accuracy measured by sluice's evaluator with
``math_verify``). It does not train anything and downloads nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""ChatML, as Qwen2 uses it (without Qwen's default system message); ``<|im_end|>`` is the eos."""

SHORTCUT = {"shopping": 0.7, "distance": 0.7, "marbles": 0.7, "ages": 0.3, "sharing": 0.3}
"""Share of each template's SFT demonstrations that box the first step's result instead."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the tiny Qwen2 (tied embeddings, grouped-query attention)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512


def read_rows(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``texts``, digits always single tokens (arithmetic stays
    learnable), the ChatML markers as special tokens and ``CHAT_TEMPLATE``. Nothing is added
    around encoded text (no bos): a rendered chat is exactly its tokens."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD, padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer: PreTrainedTokenizerFast, spec: ModelSpec, seed: int) -> Qwen2ForCausalLM:
    """A randomly initialised ``Qwen2ForCausalLM`` for ``tokenizer`` (vocabulary padded to a multiple of 8)."""
    config = Qwen2Config(
        vocab_size=-(-len(tokenizer) // 8) * 8,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **asdict(spec),
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def shortcut_solution(solution: str) -> str:
    """The solution's first sentence, then its last number boxed: a plausible early stop."""
    first = re.split(r"(?<=\.) ", solution)[0]
    return f"{first} The answer is \\boxed{{{re.findall(r'[0-9]+', first)[-1]}}}."


def demonstration_rows(rows: list[dict[str, Any]], shortcut: dict[str, float], seed: int) -> list[dict[str, Any]]:
    """``rows`` with ``extra_info.answer`` replaced by a demonstration: the worked solution, or at its
    template's ``shortcut`` rate the shortcut (one seeded draw per row)."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        demo = copy.deepcopy(row)
        info = demo["extra_info"]
        if rng.random() < shortcut.get(info["template"], 0.0):
            info["answer"] = shortcut_solution(info["answer"])
        out.append(demo)
    return out


def build(
    data_dir: Path,
    out: Path,
    *,
    vocab_size: int = 1024,
    spec: ModelSpec | None = None,
    shortcut: dict[str, float] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Tokenizer and initial model from ``data_dir/train.parquet`` saved to ``out``, and the SFT rows
    to ``data_dir/sft.parquet``; returns a summary."""
    spec = spec or ModelSpec()
    rows = read_rows(data_dir / "train.parquet")
    corpus = [m["content"] for r in rows for m in r["prompt"]] + [r["extra_info"]["answer"] for r in rows]
    tokenizer = train_tokenizer(corpus, vocab_size)
    model = build_model(tokenizer, spec, seed)
    demos = demonstration_rows(rows, SHORTCUT if shortcut is None else shortcut, seed + 7)
    pq.write_table(pa.Table.from_pylist(demos), data_dir / "sft.parquet")
    summary = {
        "vocab_size": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()),
        "model": asdict(spec),
        "sft_rows": len(demos),
        "shortcuts": sum(
            d["extra_info"]["answer"] != r["extra_info"]["answer"] for d, r in zip(demos, rows, strict=True)
        ),
    }
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "gsm8k_style_init.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> None:
    here = Path(__file__).parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=here / "data", help="folder with train.parquet; gets sft.parquet")
    parser.add_argument("--out", type=Path, default=here / "init", help="output folder of the initial model")
    parser.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    summary = build(args.data, args.out, vocab_size=args.vocab, seed=args.seed)
    print(json.dumps(summary | {"seconds": round(time.perf_counter() - started, 1)}, indent=2))


if __name__ == "__main__":
    main()

"""Give the gsm8k_style example's model a Qwen-style chat template with tools: the model folder
``config.yaml`` trains.

    python examples/qwen_tools_agent/make_model.py --base examples/gsm8k_style/runs/sft/final_model \\
        --out examples/qwen_tools_agent/model

It copies ``--base`` (a tiny ``Qwen2ForCausalLM`` with the byte-level BPE tokenizer trained on the
gsm8k_style data, built by ``examples/gsm8k_style/make_model.py`` and ``sluice sft``; ``run.sh`` builds
it when it is missing), sets the tokenizer's chat template to ``chat_template.jinja`` (ChatML with tools in the
system turn, ``<tool_call>`` blocks and ``<tool_response>`` turns, as Qwen2.5 renders them) and
raises the model's ``max_position_embeddings`` to ``--context``: a system turn listing a tool's
JSON schema is ~300 tokens for a tokenizer that never saw JSON, and Qwen2's rotary positions have
no learned table, so the longer context needs no new weights. It trains nothing, adds no token to
the vocabulary and downloads nothing; the model has never seen a tool call.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

HERE = Path(__file__).parent
TEMPLATE = HERE / "chat_template.jinja"


def build(base: Path, out: Path, context: int = 1024) -> Path:
    """``base`` copied to ``out`` with ``chat_template.jinja`` as its chat template and ``context``
    positions; returns ``out``."""
    from transformers import AutoConfig, AutoTokenizer

    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"--base {base}: no model folder (config.json); build it with examples/gsm8k_style/run.sh "
            "(make_model.py, then sluice sft)"
        )
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(out)
    config = AutoConfig.from_pretrained(out, local_files_only=True)
    config.max_position_embeddings = max(context, config.max_position_embeddings)
    config.save_pretrained(out)
    base_summary = out / "gsm8k_style_base.json"
    summary = json.loads(base_summary.read_text()) if base_summary.is_file() else {}
    summary |= {
        "base": str(base),
        "chat_template": TEMPLATE.name,
        "max_position_embeddings": config.max_position_embeddings,
    }
    (out / "qwen_tools_agent_model.json").write_text(json.dumps(summary, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base",
        type=Path,
        default=HERE.parent / "gsm8k_style" / "runs" / "sft" / "final_model",
        help="gsm8k_style's sluice sft model",
    )
    parser.add_argument("--out", type=Path, default=HERE / "model", help="output model folder")
    parser.add_argument("--context", type=int, default=1024, help="max_position_embeddings of the copy")
    args = parser.parse_args(argv)
    print(build(args.base, args.out, args.context))


if __name__ == "__main__":
    main()

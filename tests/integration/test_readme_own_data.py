"""The README's "Train your own model on your own data" run verbatim: its ``my_sft.yaml`` and
``my_run.yaml`` and its first four commands (the ``sluice sft`` warm start, a 2-step smoke run
from its final model, plot, eval on the validation file), on tiny conversational JSONL rows, a
tiny parquet dataset in verl's schema and a tiny Qwen2 with a locally trained BPE tokenizer. The
test appends only quiet settings and a shorter response cap to the lines it runs."""

import json
import re
import shlex
from pathlib import Path

import pytest

from gsm8k_example import load
from sluice.cli import main

pytestmark = pytest.mark.integration

README = Path(__file__).parents[2] / "README.md"


def _own_data_section() -> str:
    text = README.read_text()
    start = text.index("## Train your own model on your own data")
    return text[start : text.index("\n## ", start + 1)]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_the_readme_own_data_commands_run_verbatim(tmp_path, monkeypatch, capsys, request):
    """Ray already runs, started from another directory (as a cluster is): the README's relative
    paths must still reach the workers."""
    request.getfixturevalue("ray_cluster")
    section = _own_data_section()
    sft_config, config = _blocks(section, "yaml")
    [commands] = _blocks(section, "bash")
    lines = [line.split("#")[0].strip() for line in commands.splitlines() if line.strip()]
    assert len(lines) == 5 and all(line.startswith(".venv/bin/sluice ") for line in lines)

    make_data, make_model = load("make_data"), load("make_model")
    data = tmp_path / "gen"
    make_data.write_dataset(data, train=48, test=6, seed=0)
    (data / "train.parquet").rename(tmp_path / "train.parquet")
    (data / "test.parquet").rename(tmp_path / "val.parquet")
    spec = make_model.ModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip
    texts = [r["prompt"][0]["content"] for r in make_model.read_rows(tmp_path / "train.parquet")]
    tokenizer = make_model.train_tokenizer(texts, vocab_size=300)
    make_model.build_model(tokenizer, spec, seed=0).save_pretrained(tmp_path / "my_model")
    tokenizer.save_pretrained(tmp_path / "my_model")
    (tmp_path / "my_run.yaml").write_text(config)
    (tmp_path / "my_sft.yaml").write_text(sft_config)
    rows = make_model.read_rows(tmp_path / "train.parquet")
    chats = [{"messages": [*r["prompt"], {"role": "assistant", "content": r["extra_info"]["answer"]}]} for r in rows]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats[:40]))
    (tmp_path / "sft_val.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats[40:]))

    monkeypatch.chdir(tmp_path)
    quiet = ["run.progress=false", "reward.pool_size=0"]  # no progress bar, no reward processes in a test
    # the random tiny model runs most responses to the README's cap of 256 (162 tokens on average,
    # 128 responses a step): 32 keeps every line's path through config, data, Ray, eval and outputs
    short = ["rollout.max_new_tokens=32"]
    for line in lines[:4]:
        args = shlex.split(line)[1:]
        extra = quiet + short if args[0] in ("train", "eval") else quiet if args[0] == "sft" else []
        assert main(args + extra) == 0, line
    out = capsys.readouterr().out
    smoke = tmp_path / "runs" / "smoke"
    sft_records = (tmp_path / "runs" / "my_sft" / "metrics.jsonl").read_text()
    assert sft_records.count('"kind": "train"') == 3 and '"val_loss"' in sft_records  # 2 epochs of 40 rows
    assert "steps 2 in " in out and "accuracy " in out
    records = (smoke / "metrics.jsonl").read_text()
    assert records.count('"kind": "train"') == 2 and records.count('"kind": "eval"') == 2
    assert (smoke / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((smoke / "tensorboard").iterdir())
    assert not (smoke / "final_model" / "optimizer.pt").exists()
    assert "(6 val.parquet prompts, greedy)" in out

"""The CLI turns bad input into one clear line on stderr, exit code 2, and no traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.cli import EXAMPLES, main


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluice.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_dry_run_prints_resolved_config(capsys):
    assert main(["train", "--dry-run", "rollout.group_size=3", "run.name=zz"]) == 0
    out = capsys.readouterr().out
    assert "group_size: 3" in out
    assert "name: zz" in out


def test_overrides_after_an_option_count_for_train_too(tmp_path, capsys):
    config = tmp_path / "my_run.yaml"
    config.write_text("run:\n  name: mine\n")
    assert main(["train", str(config), "--dry-run", "run.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "steps: 3" in out and "name: mine" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train", "rollout.nope=1"], "rollout.nope: unknown key"),
        (["train", "rollout.group_size=many"], "rollout.group_size: Input should be a valid integer"),
        (["train", "missing.yaml"], "config file not found: missing.yaml"),
        (["train", "task.name=nosuch"], "task.name: unknown task 'nosuch'"),
        (["train", "model.path=/no/such/model"], "model.path: /no/such/model does not exist"),
        (["eval", "/no/such/model"], "model.path: /no/such/model does not exist"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, args, needle):
    proc = _run(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train", "rollout.nope=1"], "rollout.nope: unknown key"),
        (["train", "model.path=/no/such/model"], "model.path: /no/such/model does not exist"),
        (["eval", "/no/such/model"], "model.path: /no/such/model does not exist"),
        (["train", "task.name=nosuch"], "task.name: unknown task 'nosuch'"),
        (["train", "data.train_files=rows.jsonl"], "rollout.max_new_tokens: must be set with data.train_files"),
        (["train", "--dry-run", "rollout.nope=1"], "rollout.nope: unknown key"),
        (["eval", "rollout.nope=1", "/no/such/model", "--data", "val.parquet"], "rollout.nope: unknown key"),
        (["bench", "e2e", "--variants", "sync", "rollout.nope=1"], "rollout.nope: unknown key"),
        (["init", "rollout.nope=1", "--model", "m", "--data", "d.parquet"], "rollout.nope: unknown key"),
        (["init", "--model", "/no/such/model", "--data", "d.parquet"], "model.path: /no/such/model does not exist"),
    ],
)
def test_a_config_error_is_reported_without_importing_torch(tmp_path, args, needle):
    """Naming a wrong key, model folder, task or data setting must not wait seconds for torch and
    transformers to import: the CLI checks ``model.path`` and the rest ``sluice.preflight`` can
    check first, and asks only the error classes of modules already imported
    (``cli._user_errors``)."""
    child = (
        f"import resource, sys; from sluice.cli import main; code = main({args!r}); "
        "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules), "
        "sum(resource.getrusage(resource.RUSAGE_SELF)[:2]))"
    )  # CPU seconds of the whole process, interpreter start included (wall time is the machine's load)
    proc = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert needle in proc.stderr
    code, modules, seconds = proc.stdout.split()
    assert (code, modules) == ("2", "[]"), proc.stdout
    assert float(seconds) < 1.0, proc.stdout


def test_malformed_dataset_row_and_model_folder(tmp_path):
    fake_model = tmp_path / "model"
    fake_model.mkdir()
    proc = _run("eval", str(fake_model), cwd=tmp_path)
    assert proc.returncode == 2 and "has no config.json" in proc.stderr
    assert "Traceback" not in proc.stderr

    from sluice.tasks.spec import TinyLlamaSpec
    from sluice.tasks.tiny_model import build_char_tokenizer, build_tiny_llama

    tok = build_char_tokenizer("0123456789>-")
    model = build_tiny_llama(TinyLlamaSpec(hidden_size=32, num_hidden_layers=1, intermediate_size=64), tok, 0)
    model.save_pretrained(fake_model)
    tok.save_pretrained(fake_model)
    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"prompt": "12>", "answer": "21"}) + "\n" + json.dumps({"prompt": "", "answer": 1}) + "\n"
    )
    args = ("train", f"model.path={fake_model}", f"data.train_files={data}", "run.progress=false")
    proc = _run(*args, cwd=tmp_path)
    assert proc.returncode == 2 and "rollout.max_new_tokens: must be set with data.train_files" in proc.stderr
    proc = _run(*args, "rollout.max_new_tokens=8", "reward.name=exact_match", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "rows.jsonl line 2: the prompt at 'prompt' is empty" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_each_command_help_has_an_example_and_the_reference(capsys):
    commands = ["train", "eval", "init", "bench", "trace", "plot", "plan", "simulate", "plan-dag", "config-docs"]
    assert set(commands) <= set(EXAMPLES)
    for command in commands:
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert f"example:\n  sluice {command} " in out and "sluice config-docs" in out, command
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "JSONL, JSON, parquet or a datasets folder" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "args",
    [
        ["eval", "rollout.nope=1", "/no/such/model"],  # before the positional
        ["eval", "/no/such/model", "--data", "val.parquet", "rollout.nope=1"],  # after an option
        ["bench", "rollout.nope=1", "e2e"],
        ["bench", "e2e", "--variants", "sync,async η=1", "rollout.nope=1"],  # a value with '=' is no override
        ["init", "--model", "m", "rollout.nope=1", "--data", "d.jsonl"],
        ["train", "rollout.nope=1", "--dry-run"],
    ],
)
def test_overrides_count_anywhere_on_the_line_for_every_command(args, capsys):
    assert main(args) == 2
    assert "rollout.nope: unknown key" in capsys.readouterr().err


def test_a_command_without_overrides_refuses_them_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["plot", "rollout.group_size=2", "runs/x"])
    assert stop.value.code == 2
    assert "plot takes no key=value overrides (got rollout.group_size=2)" in capsys.readouterr().err


def test_dry_run_prints_only_the_sections_the_run_reads(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")  # an empty, valid header
    own = [f"model.path={model}", "data.train_files=rows.jsonl", "rollout.max_new_tokens=8", "reward.name=exact_match"]
    assert main(["train", "--dry-run", *own]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# not read by this run, left out: task, vllm, sglang, agentic, fleet\n")
    assert "\ntask:" not in out and "\nvllm:" not in out and "\ndata:" in out
    assert main(["train", "--dry-run", "rollout.engine=vllm", "task.name=calculator"]) == 0
    out = capsys.readouterr().out
    assert "\ntask:" in out and "\nvllm:" in out and "\nagentic:" in out and "\nsglang:" not in out

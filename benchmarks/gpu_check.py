"""One check of sluice on a GPU machine without Ray: what runs, how fast, in one table.

Rows, each in a process of its own (a crash, hang or out-of-memory in one is that row's FAIL;
the others still run; each row's peak CUDA memory is its own):

- ``imports``: ``import sluice``, ``sluice.cli``, ``sluice.rl_trainer`` (and whether Ray is there);
- ``model``: a random-init Qwen2-shaped model of ~0.5B parameters (hidden 896, 24 layers, 14 / 2
  heads, intermediate 4864, Qwen2.5's 151936-token vocabulary) with the default task's
  character tokenizer, saved as a Hugging Face folder (bf16);
- ``trainer single`` / ``trainer fsdp2``: ``sections.train_engine`` with ``trainer.strategy`` and
  ``dtype: bfloat16``, optimizer steps of synthetic GRPO groups (the first one is warm-up): step
  time, tokens / s, peak memory, loss finite. ``fsdp2`` runs as one rank (the engine sets up its
  process group); ``n/a`` when this sluice leaves the model unsharded;
- ``engine``: ``HFInferenceEngine`` in bf16 generating one batch: generated tokens / s;
- ``train sync`` / ``train async``: ``sluice train run.backend=local`` on the default task and
  its default tiny model (built and cached by the first of them): wall time, the training loop's
  time (``metrics.jsonl``), final accuracy and reward; the device is ``cuda`` when the process
  allocated CUDA memory.

``--small`` shrinks everything (tiny model, one step) so ``--device cpu --small`` runs the whole
driver on a CPU machine in a test. It does not compare against other frameworks or tune
anything. ``scripts/gpu_check.sh`` installs the wheels it needs and runs it.

    PYTHONPATH=src python benchmarks/gpu_check.py [--device cuda] [--small] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROWS = ("imports", "model", "trainer single", "trainer fsdp2", "fsdp2 offl+ckpt", "engine", "train sync", "train async")
MARK = "GPU_CHECK_ROW "
FULL = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151936}
SMALL = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 64}


class NotAvailable(Exception):
    """The check's feature is not in this sluice yet (reported as ``n/a``, not a failure)."""


def _sizes(small: bool) -> dict[str, int]:
    if small:
        return {"groups": 2, "group_size": 2, "prompt": 8, "response": 8, "steps": 1, "batch": 4, "new": 8}
    return {"groups": 8, "group_size": 8, "prompt": 128, "response": 384, "steps": 4, "batch": 64, "new": 256}


def _peak(device: str) -> dict[str, Any]:
    import torch

    if device != "cuda":
        return {}
    return {"peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def check_imports(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    import sluice
    import sluice.cli
    import sluice.rl_trainer  # noqa: F401

    ray = "present" if importlib.util.find_spec("ray") is not None else "absent"
    return {"seconds": time.perf_counter() - started, "detail": f"sluice, cli, rl_trainer imported; ray {ray}"}


def check_model(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sluice.tasks import TASKS
    from sluice.tasks.tiny_model import build_char_tokenizer

    started = time.perf_counter()
    shape = SMALL if args.small else FULL
    tok = build_char_tokenizer(TASKS["reverse_digits"].alphabet)
    config = Qwen2Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        intermediate_size=shape["intermediate"], max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(args.model_dir)
    tok.save_pretrained(args.model_dir)
    return {"seconds": time.perf_counter() - started, "detail": f"Qwen2 {params / 1e6:.4g}M parameters, saved in bf16"}


def _vocab(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def _samples(args: argparse.Namespace, step: int, vocab: int) -> list[Any]:
    """One step of synthetic GRPO groups: random prompt / response tokens, rewards 0 or 1."""
    from sluice.api.types import Sample

    size, rng, out = _sizes(args.small), random.Random(step), []
    behav = -math.log(vocab)  # a random model's log-prob of a random token: ratios near 1
    for g in range(size["groups"]):
        prompt = tuple(rng.randrange(4, vocab) for _ in range(size["prompt"]))
        for k in range(size["group_size"]):
            n = rng.randint(max(1, size["response"] // 4), size["response"])
            resp = tuple(rng.randrange(4, vocab) for _ in range(n))
            group = step * size["groups"] + g
            out.append(Sample(f"{group}-{k}", group, prompt, resp, (behav,) * n, (0,) * n, (1,) * n, float(k % 2)))
    return out


def _train_steps(args: argparse.Namespace, engine: Any, cfg: Any) -> tuple[list[float], list[float], float]:
    from sluice.trainer.sections import algorithm_of
    from sluice.trainer.step import plan_step, run_step, step_normaliser

    algorithm, vocab = algorithm_of(cfg), _vocab(args.model_dir)
    times, losses, tokens = [], [], 0.0
    for step in range(_sizes(args.small)["steps"]):
        samples = _samples(args, step, vocab)
        _sync(args.device)
        started = time.perf_counter()
        metrics = run_step(engine, plan_step(samples, algorithm, cfg.micro_batch_tokens), algorithm,
                           step_normaliser(samples, algorithm))  # fmt: skip
        _sync(args.device)
        times.append(time.perf_counter() - started)
        losses.append(float(metrics["loss"]))
        tokens = sum(s.num_tokens for s in samples)
    return times, losses, tokens


def check_trainer(args: argparse.Namespace, strategy: str, **options: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    from sluice.config import TrainerConfig
    from sluice.trainer.data_parallel import DataParallelGroup
    from sluice.trainer.rendezvous import free_tcp_address
    from sluice.trainer.sections import train_engine

    cfg = TrainerConfig(strategy=strategy, dtype="bfloat16", **options)
    engine = train_engine(args.model_dir, cfg, 1.0, _sizes(args.small)["steps"])  # on the visible GPU
    try:
        param = next(engine.model.parameters())
        if param.device.type != args.device:
            raise RuntimeError(f"train_engine placed the model on {param.device}, not {args.device}")
        if strategy != "single":  # one rank of its own group, as TrainerWorker does for resources.trainer.ranks=1
            DataParallelGroup(free_tcp_address(), 0, 1, engine.device)
            engine.distribute(strategy, cpu_offload=cfg.cpu_offload)  # offload: the shards move to CPU
        param = next(engine.model.parameters())
        sharded = any(isinstance(p, DTensor) for p in engine.model.parameters())
        if strategy == "fsdp2" and not sharded:
            raise NotAvailable("train_engine left the model unsharded with trainer.strategy=fsdp2")
        times, losses, tokens = _train_steps(args, engine, cfg)
    finally:
        with contextlib.suppress(AttributeError):
            engine.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    step_s = statistics.median(times[1:] or times)
    row = {"seconds": sum(times), "tokens_per_s": tokens / step_s, "step_s": step_s, "losses": losses}
    row["detail"] = (f"{len(times)} steps of {tokens:.0f} tokens, step {step_s:.3f} s, params {param.dtype}, "
                     f"sharded {sharded}, loss {losses[-1]:.4g}"
                     + "".join(f", {k} {v}" for k, v in options.items()))  # fmt: skip
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"loss not finite: {losses}")
    return row


def check_engine(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from sluice.api.types import GenerationRequest, SamplingParams
    from sluice.engines.hf_inference import HFInferenceEngine
    from sluice.engines.hf_model import load_causal_lm

    size = _sizes(args.small)
    engine = HFInferenceEngine(load_causal_lm(args.model_dir, dtype=torch.bfloat16), device=args.device,
                               max_batch=size["batch"])  # fmt: skip
    vocab, rng = _vocab(args.model_dir), random.Random(0)

    def generate(tag: str, count: int, new: int) -> tuple[int, float]:
        futures = [
            engine.submit(GenerationRequest(f"{tag}{i}", tuple(rng.randrange(4, vocab) for _ in range(size["prompt"])),
                                            SamplingParams(max_new_tokens=new, temperature=1.0), seed=i))
            for i in range(count)
        ]  # fmt: skip
        _sync(args.device)
        started = time.perf_counter()
        while engine.has_work():
            engine.step()
        _sync(args.device)
        return sum(len(f.result().token_ids) for f in futures), time.perf_counter() - started

    generate("warm", 2, 4)
    tokens, seconds = generate("req", size["batch"], size["new"])
    detail = f"{size['batch']} requests × {size['new']} new tokens, prompt {size['prompt']}, {tokens} generated"
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "detail": detail}


def check_train(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    import torch

    from sluice.cli import main as sluice_main

    run = [f"run.mode={mode}", "run.backend=local", f"run.output_dir={args.workdir}", f"run.name={mode}",
           "run.progress=false", "tracking.plot=false"]  # fmt: skip
    if args.small:  # the random small model, one tiny step, rewards scored in the process
        run += [f"model.path={args.model_dir}", "run.steps=1", "run.eval_every=0", "run.threads=1",
                "rollout.group_size=2", "rollout.prompts_per_step=2", "rollout.max_new_tokens=8",
                "task.train_prompts=8", "reward.pool_size=0"]  # fmt: skip
    else:  # the default task's tiny model from model.cache_dir (carry .cache/sluice to skip its warm start)
        run += ["run.steps=5", "run.eval_every=5", "task.eval_prompts=64"]
    started = time.perf_counter()
    code = sluice_main(["train", *run])
    wall = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"sluice train exited with {code}")
    records = [json.loads(line) for line in (Path(args.workdir) / mode / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval" and "accuracy" in r]
    loop_start = max((r["elapsed_s"] for r in evals if r["elapsed_s"] <= train[0]["elapsed_s"]), default=0.0)
    loop_s = train[-1]["elapsed_s"] - loop_start
    cuda = torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0
    accuracy = f"accuracy {evals[0]['accuracy']:.3f} → {evals[-1]['accuracy']:.3f}, " if evals else ""
    return {
        "device": "cuda" if cuda else "cpu", "seconds": wall, "loop_s": loop_s,
        "tokens_per_s": sum(r["trained_tokens"] for r in train) / max(loop_s, 1e-9),
        "detail": f"{len(train)} steps, loop {loop_s:.1f} s, {accuracy}reward {train[-1]['reward_mean']:.3f}",
        "final_accuracy": evals[-1]["accuracy"] if evals else None, "final_reward": train[-1]["reward_mean"],
    }  # fmt: skip


def run_row(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Run one check in this process: its row, status ``ok`` / ``n/a`` / ``FAIL`` with the reason."""
    checks = {
        "imports": check_imports, "model": check_model, "engine": check_engine,
        "trainer single": lambda a: check_trainer(a, "single"), "trainer fsdp2": lambda a: check_trainer(a, "fsdp2"),
        "fsdp2 offl+ckpt": lambda a: check_trainer(a, "fsdp2", cpu_offload=a.device == "cuda",
                                                   activation_checkpointing=True),
        "train sync": lambda a: check_train(a, "sync"), "train async": lambda a: check_train(a, "async"),
    }  # fmt: skip
    row: dict[str, Any] = {"check": name, "device": args.device}
    try:
        row.update(checks[name](args))
        row["status"] = "ok"
    except NotAvailable as err:  # deliberately: a feature this sluice lacks is reported, not raised
        row.update(status="n/a", detail=str(err))
    except Exception as err:  # deliberately: a failing check is this row's FAIL, the next rows still run
        row.update(status="FAIL", detail=f"{type(err).__name__}: {err}".splitlines()[0][:300])
    row.update(_peak(args.device) if row["device"] == "cuda" else {})
    return row


def _child(args: argparse.Namespace, name: str, timeout: float) -> dict[str, Any]:
    """``name``'s row from a process of its own; a crash or timeout is the row's FAIL."""
    cmd = [sys.executable, __file__, "--row", name, "--device", args.device, "--model-dir", args.model_dir,
           "--workdir", args.workdir, *(["--small"] if args.small else [])]  # fmt: skip
    # its own session: on a timeout the kill takes the processes it started too (reward workers)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"check": name, "status": "FAIL", "device": args.device, "detail": f"timed out after {timeout:.0f} s"}
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = [line for line in stderr.splitlines() if line.strip()][-1:] or ["no output"]
    return {"check": name, "status": "FAIL", "device": args.device, "detail": f"exit {proc.returncode}: {tail[0]}"}


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'check':<15} {'status':<6} {'device':<6} {'time s':>7} {'tokens/s':>9} {'peak GiB':>8}  detail")
    for r in rows:
        tps = f"{r['tokens_per_s']:>9.0f}" if "tokens_per_s" in r else f"{'-':>9}"
        peak = f"{r['peak_gib']:>8.2f}" if "peak_gib" in r else f"{'-':>8}"
        secs = f"{r['seconds']:>7.1f}" if "seconds" in r else f"{'-':>7}"
        print(f"{r['check']:<15} {r['status']:<6} {r['device']:<6} {secs} {tps} {peak}  {r.get('detail', '')}")


def _environment(device: str) -> dict[str, Any]:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="tiny model, one step (a CPU test)")
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else None
    parser.add_argument("--out", default=str(default_out or "benchmarks/results/gpu_check.json"))
    parser.add_argument("--row-timeout", type=float, default=180.0, help="seconds per row's process")
    parser.add_argument("--rows", nargs="*", choices=ROWS, help="run only these rows (and the model they use)")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all rows; later rows FAIL unrun")
    parser.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # internal: one row, in this process
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row is not None:
        print(MARK + json.dumps(run_row(args, args.row)), flush=True)
        return 0
    from harness.report import write_results

    with tempfile.TemporaryDirectory(prefix="sluice-gpu-check-") as tmp:
        args.workdir, args.model_dir = tmp, str(Path(tmp) / "model")
        rows, deadline = [], time.monotonic() + args.budget
        for name in [r for r in ROWS if not args.rows or r in args.rows or r == "model"]:
            left = deadline - time.monotonic()
            if left < 1:
                rows.append({"check": name, "status": "FAIL", "device": args.device, "detail": "--budget spent"})
                continue
            rows.append(_child(args, name, min(args.row_timeout, left)))
    env = _environment(args.device)
    print(", ".join(f"{k} {v}" for k, v in env.items()))
    _print_table(rows)
    args.workdir = args.model_dir = None
    write_results(args.out, args, rows, environment=env)
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The profile phase of ``planner_validation.py``: short real measurements on this machine, taken
in-process with nothing else of sluice running beside them (not one of the declared
configurations).

- ``task_lengths``: the default task's prompt and answer token lengths as a log-normal;
- ``profile_decode``: the built-in HF engine's decode iteration time against its running batch,
  fitted to ``decode_s · max(1, batch / knee)``;
- ``profile_trainer``: the real ``TrainerWorker`` (the default run's model, algorithm, micro-batch
  token budget and trainer thread count) training whole steps of groups the policy sampled
  (generated before each step is timed), read from a local queue, alone on the machine: its
  seconds per token when nothing decodes beside it. The
  calibration runs give the same trainer's rate while it shares the CPU with decoding; the ratio
  is the simulator's ``TrainerCost.alone_speedup``. The responses it samples (every step's groups,
  ``steps · prompts_per_step`` prompts × the group size) are kept as ``response_lengths``: the
  policy's own length distribution, per prompt, for the simulator.

It does not run ``sluice train`` (``planner_validation.measure`` does) or calibrate anything.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from typing import Any

from harness.fit import fit_decode


def _task_model() -> tuple[Any, Any, Any]:
    from sluice.config import load_config
    from sluice.engines.hf_model import load_tokenizer
    from sluice.tasks import TASKS
    from sluice.tasks.base_model import ensure_base_model

    cfg = load_config(None, [])
    task = TASKS[cfg.task.name]
    model_dir = ensure_base_model(task, cfg.model.cache_dir, cfg.run.seed, cfg.task.eval_prompts)
    return task, model_dir, load_tokenizer(model_dir)


def task_lengths(count: int = 4000) -> dict[str, float]:
    """Prompt and answer token lengths of the default task, as a log-normal ``LengthModel``
    (answers are determined by the prompt: the spread is between prompts)."""
    task, _, tokenizer = _task_model()
    rng = random.Random(0)
    rows = [task.make_row(rng) for _ in range(count)]
    prompts = [len(tokenizer(r["prompt"])["input_ids"]) for r in rows]
    answers = [len(tokenizer(r["answer"])["input_ids"]) + 1 for r in rows]  # + <eos>
    logs = [math.log(a) for a in answers]
    return {"prompt_len": statistics.mean(prompts), "median": math.exp(statistics.median(logs)),
            "sigma": statistics.pstdev(logs), "max_new_tokens": task.max_new_tokens}  # fmt: skip


def profile_decode() -> dict[str, Any]:
    """Decode iteration seconds at running batches 1..512 (the fastest of the first decode
    steps after the whole batch is admitted, over five sweeps: other processes only ever add
    time), fitted to the knee model."""
    import torch

    from sluice.api import GenerationRequest, SamplingParams
    from sluice.engines.hf_inference import HFInferenceEngine
    from sluice.engines.hf_model import load_causal_lm

    torch.set_num_threads(1)
    _, model_dir, tokenizer = _task_model()
    engine = HFInferenceEngine(load_causal_lm(model_dir), max_batch=512, admit_fraction=1.0)
    prompt = tuple(tokenizer("1234567890123456>")["input_ids"])
    batches, seconds = [], []
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) * 5:
        params = SamplingParams(max_new_tokens=8, stop_token_ids=())
        futures = [engine.submit(GenerationRequest(f"p{batch}-{i}", prompt, params, seed=i)) for i in range(batch)]
        engine.step()  # admit + prefill + first decode
        times: list[float] = []
        while engine.stats()["running"] == batch and len(times) < 5:
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        while engine.has_work():
            engine.step()
        assert all(f.done() for f in futures)
        batches.append(batch)
        seconds.append(min(times))
    best = {b: min(s for bb, s in zip(batches, seconds, strict=True) if bb == b) for b in batches}
    batches, seconds = list(best), list(best.values())
    fit = fit_decode(batches, seconds)
    return {"batches": batches, "seconds": seconds, "decode_s": fit.decode_s, "knee": fit.knee, "rms_s": fit.rms_s}


def _sampled_groups(trainer: Any, engine: Any, groups: int, first_group: int, rng: random.Random) -> list[Any]:
    """``groups`` groups of the task's prompts with responses the policy samples with the run's
    sampling parameters (so their lengths are the run's), and 0/1 rewards, so the advantages are
    not all zero (the trainer's cost does not depend on the rewards' values)."""
    from sluice.api import GenerationRequest, Sample

    size = trainer.config.rollout.group_size
    prompts = [tuple(trainer.tokenizer(trainer.task.make_row(rng)["prompt"])["input_ids"]) for _ in range(groups)]
    futures = {
        (g, k): engine.submit(
            GenerationRequest(f"g{g}-{k}", prompts[g - first_group], trainer.params, seed=rng.getrandbits(31))
        )
        for g in range(first_group, first_group + groups)
        for k in range(size)
    }
    while engine.has_work():
        engine.step()
    out = []
    for g in range(first_group, first_group + groups):
        done = [futures[g, k].result() for k in range(size)]
        out.append([
            Sample(uid=c.request_id, group_id=g, prompt_ids=c.prompt_ids, response_ids=c.token_ids,
                   behav_logprobs=c.logprobs, token_versions=c.versions, loss_mask=tuple(1 for _ in c.token_ids),
                   reward=float(rng.random() < 0.5))
            for c in done
        ])  # fmt: skip
    return out


def profile_trainer(prompts_per_step: int = 32, steps: int = 8, skip: int = 2, chunk: int = 4) -> dict[str, Any]:
    """The run's own trainer worker alone: ``steps`` whole steps of ``prompts_per_step`` groups
    (handed over ``chunk`` groups at a time, as the controller streams them), each timed as the
    calibration times a real step — busy seconds (the step minus the queue reads) over the
    trained tokens, prompts included. Returns the mean over the steps after ``skip``, and every
    sampled group's response lengths (``response_lengths``, one list per prompt)."""
    from sluice.config import load_config
    from sluice.engines.hf_inference import HFInferenceEngine
    from sluice.engines.hf_model import load_causal_lm
    from sluice.queue import LocalQueue
    from sluice.queue.samples import samples_to_rows
    from sluice.rl_trainer import RLTrainer
    from sluice.runtime.pipelines import queue_tasks, trainer_kwargs
    from sluice.trainer.worker import TrainerWorker
    from sluice.weights import InProcessWeightSync

    trainer = RLTrainer(load_config(None, []))
    trainer.init_engines()  # the async run's algorithm, schedule and engine arguments; no engines
    spec = trainer.pipeline_spec()
    queue = LocalQueue()
    for task, columns in queue_tasks(spec).items():
        queue.register_task(task, columns)
    worker = TrainerWorker(**trainer_kwargs(spec, queue, InProcessWeightSync()))  # sets the run's threads
    engine = HFInferenceEngine(load_causal_lm(spec.model_dir), max_batch=spec.config.rollout.max_batch)
    rng = random.Random(0)
    rates, busy, tokens, lengths = [], [], [], []
    for step in range(steps):
        groups = _sampled_groups(trainer, engine, prompts_per_step, step * prompts_per_step, rng)
        lengths += [[len(s.response_ids) for s in g] for g in groups]
        for group in groups:
            queue.put(*samples_to_rows(group, spec.config.rollout.group_size))
        step_tokens = sum(s.num_tokens for g in groups for s in g)
        start = time.perf_counter()
        worker.begin_step()
        for i in range(0, len(groups), chunk):
            worker.add_groups([g[0].group_id for g in groups[i : i + chunk]])
        metrics = worker.finish_step()
        seconds = time.perf_counter() - start - metrics["wait_data_s"]
        if step >= skip:
            rates.append(seconds / step_tokens)
            busy.append(seconds)
            tokens.append(step_tokens)
    queue.close()
    return {"token_s": statistics.mean(rates), "step_busy_s": busy, "step_tokens": tokens,
            "micro_batch_tokens": spec.config.trainer.micro_batch_tokens, "threads": spec.trainer_threads,
            "prompts_per_step": prompts_per_step, "response_lengths": lengths}  # fmt: skip

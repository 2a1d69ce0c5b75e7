"""Load a local Hugging Face model folder (config, weights, tokenizer) with clear errors.

The only place that resolves ``model.path``: it checks the folder (``model_folder.py``) before
transformers sees it, so a wrong path ends with one message naming the field instead of a
hub-download traceback.
It never downloads (``local_files_only``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
)
from transformers.utils import logging as hf_logging

from sluice.engines.model_folder import ModelPathError, check_model_dir, check_reward_model_dir


def load_tokenizer(path: str | Path) -> Any:
    p = check_model_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelPathError(f"model.path: cannot load a tokenizer from {p}: {err}") from None
    if tokenizer.eos_token_id is None:
        raise ModelPathError(f"model.path: the tokenizer in {p} has no eos_token; responses could not stop")
    return tokenizer


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    p = check_model_dir(path)
    hf_logging.disable_progress_bar()  # per-load bars would flood the run's log
    try:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelPathError(f"model.path: cannot load a causal LM from {p}: {err}") from None
    return model


def load_scalar_model(
    path: str | Path, *, field: str = "reward.model", new_head: bool = False, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A sequence-classification model with one label (a scalar reward model): the folder's own
    (``new_head=False``: anything else is refused naming ``field``), or a causal LM's trunk with a
    fresh ``score`` head (``new_head=True``: what ``sluice rm`` starts from). Its ``pad_token_id``
    is the tokenizer's, so padded rows are read at their last real token."""
    p = check_model_dir(path, field) if new_head else check_reward_model_dir(path, field)
    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(p, local_files_only=True)
    tokenizer = load_tokenizer(p) if config.pad_token_id is None else None
    if tokenizer is not None:
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config.num_labels = 1
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights newly initialized": the score head, on purpose
    try:
        model = AutoModelForSequenceClassification.from_pretrained(p, config=config, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelPathError(f"{field}: cannot load a sequence-classification model from {p}: {err}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return model


def check_state_names(model: PreTrainedModel, weights: Mapping[str, torch.Tensor]) -> None:
    """Refuse an update whose names or shapes do not cover ``model``'s parameters exactly (tied
    aliases count once)."""
    state = model.state_dict()
    unknown = sorted(set(weights) - set(state))
    bad = [n for n, w in weights.items() if n in state and w.shape != state[n].shape]
    covered = {state[n].data_ptr() for n in weights if n in state}
    missing = [n for n, p in model.named_parameters() if p.data_ptr() not in covered]
    problems = [("unknown names", unknown), ("missing parameters", missing), ("shape mismatch", bad)]
    if any(names for _, names in problems):
        detail = "; ".join(f"{what} {names[:5]} ({len(names)})" for what, names in problems if names)
        raise ValueError(f"update_weights: {detail}")


def stage_weights(
    host: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """Copy ``weights`` into the reusable host buffers ``host`` (pinned when ``device`` is CUDA)."""
    for name, w in weights.items():
        buf = host.get(name)
        if buf is None or buf.shape != w.shape or buf.dtype != w.dtype:
            buf = torch.empty(w.shape, dtype=w.dtype, pin_memory=device.type == "cuda")
            host[name] = buf
        buf.copy_(w.detach())
    return {name: host[name] for name in weights}


def worker_device() -> torch.device:
    """The device this process's placement gives it: in a Ray worker, the GPU Ray assigned it
    (Ray sets ``CUDA_VISIBLE_DEVICES`` to it, so it is ``cuda``), the CPU when it assigned none;
    elsewhere its GPU when one is visible, else the CPU."""
    return device_for(ray_gpu_ids(), torch.cuda.is_available())


def device_for(ray_gpus: list[Any] | None, cuda_available: bool) -> torch.device:
    """``ray_gpus``: the GPU ids Ray gave this worker (``None``: not a Ray worker)."""
    if ray_gpus is not None:
        return torch.device("cuda") if ray_gpus and cuda_available else torch.device("cpu")
    return torch.device("cuda") if cuda_available else torch.device("cpu")


def ray_gpu_ids() -> list[Any] | None:
    """``ray.get_gpu_ids()`` in a Ray worker process; ``None`` in a driver or without Ray (never
    imports Ray itself)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    from ray._private.worker import WORKER_MODE, global_worker

    return list(ray.get_gpu_ids()) if global_worker.mode == WORKER_MODE else None


def on_device(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` moved, in place, to ``worker_device()``."""
    torch.nn.Module.to(model, worker_device())  # transformers' typed `.to` confuses mypy
    return model


def slow_bf16_reason(device: torch.device) -> str | None:
    """Why bf16 compute would be slow on ``device`` (a CPU without AVX512-BF16 / AMX emulates bf16
    matmuls, measured ~150x slower than fp32 on an AVX2 host), or ``None``."""
    if device.type != "cpu":
        return None
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        return None
    return f"this CPU has no AVX512-BF16 / AMX (torch capability {torch.backends.cpu.get_cpu_capability()})"

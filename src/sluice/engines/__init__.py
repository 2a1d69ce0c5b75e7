"""Engines: the only modules that import engine libraries. ``hf_inference`` generates with the
built-in torch engine, ``vllm_engine`` with vLLM, ``sglang_engine`` through an SGLang server;
``hf_train`` trains, ``hf_model`` loads a model folder, ``weight_folder`` stages weight updates
for engines in other processes.

``INFERENCE_ENGINES`` maps ``rollout.engine`` to a builder; each imports its library only when
called, so ``import sluice`` needs neither vLLM nor SGLang.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sluice.api.protocols import InferenceEngine


def _hf(model_dir: str | Path, max_batch: int, options: Mapping[str, Any]) -> InferenceEngine:
    """The built-in engine on this worker's device, in ``options["dtype"]`` (``rollout.dtype``)."""
    import torch

    from sluice.engines.hf_inference import HFInferenceEngine
    from sluice.engines.hf_model import load_causal_lm, worker_device

    rest = {k: v for k, v in options.items() if k != "dtype"}
    model = load_causal_lm(model_dir, dtype=getattr(torch, options.get("dtype", "float32")))
    return HFInferenceEngine(model, max_batch=max_batch, device=str(worker_device()), **rest)


def _vllm(model_dir: str | Path, max_batch: int, options: Mapping[str, Any]) -> InferenceEngine:
    from sluice.engines.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, max_batch=max_batch, **options)


def _sglang(model_dir: str | Path, max_batch: int, options: Mapping[str, Any]) -> InferenceEngine:
    from sluice.engines.sglang_engine import SGLangEngine

    return SGLangEngine(model_dir, **options)


INFERENCE_ENGINES: dict[str, Callable[[str | Path, int, Mapping[str, Any]], InferenceEngine]] = {
    "hf": _hf,
    "vllm": _vllm,
    "sglang": _sglang,
}


def build_inference_engine(
    name: str, model_dir: str | Path, *, max_batch: int, options: Mapping[str, Any] | None = None
) -> InferenceEngine:
    """The ``rollout.engine`` called ``name`` serving ``model_dir`` (``options``: its config section)."""
    if name not in INFERENCE_ENGINES:
        raise ValueError(f"rollout.engine: unknown engine {name!r} (built-in: {', '.join(INFERENCE_ENGINES)})")
    return INFERENCE_ENGINES[name](model_dir, max_batch, options or {})

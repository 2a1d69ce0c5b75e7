"""LoRA adapters on a Hugging Face causal LM via ``peft``: train the adapters, export merged weights.

``apply_lora`` wraps a model so that only the low-rank adapters ``A``, ``B`` of the target linear
layers require grad (the base weights stay frozen). ``merged_weights`` gives the state dict of
the plain model with every adapted weight replaced by ``W + scale · B A`` under the plain model's
parameter names, computed without touching the trained model (merging in place and unmerging
would leave rounding errors in the base weights). Engines load that dict like any full-weight
update, so inference engines never need to know about adapters. ``save_merged`` writes a plain
HF folder (``sluice eval`` reads it like any model).

``peft`` is an optional dependency (``pip install sluice[lora]``): it is imported only when a
model is wrapped. Deliberately not here: sending adapters alone to engines that could apply
them (vLLM's LoRA requests), QLoRA, and several adapters per model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

ADAPTER = "default"
ADAPTER_DIR = "adapter"
BASE_INFIX = ".base_layer"


@dataclass(frozen=True)
class LoraSpec:
    """The adapters to train: rank ``r``, scale ``alpha / r``, on the named linear modules."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    dropout: float = 0.0


def apply_lora(model: PreTrainedModel, spec: LoraSpec) -> torch.nn.Module:
    """``model`` wrapped with fresh adapters (``B = 0``, so it computes the same function);
    only adapter parameters require grad."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=list(spec.target_modules)
    )
    return get_peft_model(model, config)


def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict (new tensors) with the adapters merged in; tied tensors
    stay shared."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()  # type: ignore[operator]
    adapted = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in base.state_dict().items():
            if ".lora_" in name:
                continue
            plain = name.replace(BASE_INFIX, "")
            owner = name.rsplit(BASE_INFIX, 1)[0] if BASE_INFIX in name else None
            if owner in adapted and name.endswith(".weight"):
                out[plain] = tensor.detach() + adapted[owner].get_delta_weight(ADAPTER)
                continue
            key = tensor.data_ptr()
            if key not in copies:
                copies[key] = tensor.detach().clone()
            out[plain] = copies[key]
    return out


def save_merged(model: torch.nn.Module, path: str | Path) -> None:
    """Write the merged model as a plain HF folder (config + weights) and the adapters alone
    under ``path/ADAPTER_DIR`` (what ``load_adapters`` restores)."""
    base = model.get_base_model()  # type: ignore[operator]
    plain = type(base)(base.config)
    plain.load_state_dict(merged_weights(model))
    plain.save_pretrained(path)
    model.save_pretrained(Path(path) / ADAPTER_DIR)  # type: ignore[operator]


def load_adapters(model: torch.nn.Module, path: str | Path) -> None:
    """Restore the adapter weights that ``save_merged`` wrote (in place; base weights untouched)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(path) / ADAPTER_DIR / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state)
    if result.unexpected_keys:
        raise ValueError(f"{path}: adapter weights do not fit this model: {result.unexpected_keys[:3]}")

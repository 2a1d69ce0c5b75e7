"""LoRA adapters on a Hugging Face causal LM via ``peft``: train the adapters, export merged weights.

``apply_lora`` wraps a model so that only the low-rank adapters ``A``, ``B`` of the target linear
layers require grad (the base weights stay frozen). ``merged_weights`` gives the state dict of
the plain model with every adapted weight replaced by ``W + scale · B A`` under the plain model's
parameter names (``LoraMerge``: the recipe, which a sharded model's bucketed gather follows too),
computed without touching the trained model (merging in place and unmerging
would leave rounding errors in the base weights). Engines load that dict like any full-weight
update, so inference engines never need to know about adapters. ``save_merged`` writes a plain
HF folder (``sluice eval`` reads it like any model).

``peft`` is an optional dependency (``pip install sluice[lora]``): it is imported only when a
model is wrapped. Deliberately not here: sending adapters alone to engines that could apply
them (vLLM's LoRA requests), QLoRA, and several adapters per model.
"""

from __future__ import annotations

from collections.abc import Callable
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


@dataclass(frozen=True)
class LoraMerge:
    """How the plain model's weights are made from a LoRA-wrapped model's state dict: each plain
    name's base tensor, and for an adapted weight its ``A``, ``B`` and scale
    (``W + scale · B A``). Works on any copy of that state dict (local, or gathered shards)."""

    sources: dict[str, tuple[str, str, str, float] | str]
    """Plain name → the wrapped state dict's key, or ``(base, A, B, scale)`` for an adapted weight."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> LoraMerge:
        from peft.tuners.lora import LoraLayer

        adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
        prefix = next(name for name, _ in model.named_modules() if name.endswith("base_model.model")) + "."
        sources: dict[str, tuple[str, str, str, float] | str] = {}
        for key in model.state_dict():
            if ".lora_" in key:
                continue
            plain = key.removeprefix(prefix).replace(BASE_INFIX, "")
            owner = key.rsplit(BASE_INFIX, 1)[0] if BASE_INFIX in key else None
            if owner in adapted and key.endswith(".weight"):
                layer = adapted[owner]
                if getattr(layer, "fan_in_fan_out", False):
                    raise ValueError(f"LoRA on {owner}: fan_in_fan_out layers are not supported")
                a, b = f"{owner}.lora_A.{ADAPTER}.weight", f"{owner}.lora_B.{ADAPTER}.weight"
                sources[plain] = (key, a, b, float(layer.scaling[ADAPTER]))
            else:
                sources[plain] = key
        return cls(sources)

    def tensor(self, name: str, fetch: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The plain model's tensor ``name``, from the wrapped state dict's tensors ``fetch`` gives."""
        source = self.sources[name]
        if isinstance(source, str):
            return fetch(source)
        base, a, b, scale = source
        with torch.no_grad():
            return fetch(base) + scale * (fetch(b) @ fetch(a))


def merged_weights(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The plain model's state dict (new tensors) with the adapters merged in, from ``state`` (the
    wrapped model's full state dict; default its own); tied tensors stay shared."""
    state = model.state_dict() if state is None else state
    merge = LoraMerge.of(model)
    copies: dict[int, torch.Tensor] = {}

    def copied(key: str) -> torch.Tensor:
        tensor = state[key]
        if tensor.data_ptr() not in copies:
            copies[tensor.data_ptr()] = tensor.detach().clone()
        return copies[tensor.data_ptr()]

    out = {}
    for name, source in merge.sources.items():
        out[name] = copied(source) if isinstance(source, str) else merge.tensor(name, lambda k: state[k].detach())
    return out


def save_merged(model: torch.nn.Module, path: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write the merged model as a plain HF folder (config + weights) and the adapters alone
    under ``path/ADAPTER_DIR`` (what ``load_adapters`` restores). ``state``: the wrapped model's
    full state dict (a sharded model's, gathered); default its own."""
    base = model.get_base_model()  # type: ignore[operator]
    plain = type(base)(base.config)
    plain.load_state_dict(merged_weights(model, state))
    plain.save_pretrained(path)
    model.save_pretrained(Path(path) / ADAPTER_DIR, state_dict=state)  # type: ignore[operator]


def load_adapters(model: torch.nn.Module, path: str | Path) -> None:
    """Restore the adapter weights that ``save_merged`` wrote (in place; base weights untouched)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(path) / ADAPTER_DIR / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state)
    if result.unexpected_keys:
        raise ValueError(f"{path}: adapter weights do not fit this model: {result.unexpected_keys[:3]}")

"""The inference engine's forwards without transformers' per-call wrappers.

A decode step of a small model is dispatch, not arithmetic: on the default task's model a
forward of 8 rows costs ≈ 3 ms, and about a sixth of it is spent around the layers, in the
wrappers of ``LlamaForCausalLM.forward`` / ``LlamaModel.forward`` (the kwarg deprecation shims,
config-default merging, output capturing, the output dataclasses). For the causal LMs whose model
forward is exactly embed → ``create_causal_mask`` → rotary → layers → norm → ``lm_head`` (Llama,
and Qwen2 without sliding-window layers), ``causal_lm_logits`` calls the same modules and the same
mask function with the same arguments in the same order: every bit is the library's
(``tests/unit/test_lean_forward.py`` compares them bit for bit). Any other model, or a library
whose layers take other arguments, runs its own forward.

Not here: training forwards (autograd, activation checkpointing and FSDP hooks live in the
library's forward, and the trainer keeps it), the KV cache (the caller's), sampling.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

from torch import Tensor

LEAN_MODELS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"})
"""Model classes whose model forward the lean path repeats step for step (transformers 5)."""


def causal_lm_logits(
    model: Any, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor, cache: Any, last_only: bool
) -> Tensor:
    """The logits ``[rows, T or 1, V]`` of ``model(input_ids=..., attention_mask=...,
    position_ids=..., past_key_values=cache, use_cache=True)`` (``last_only``: of the last
    position, as ``logits_to_keep=1``), filling ``cache``."""
    if not lean_supported(model):
        keep = {"logits_to_keep": 1} if last_only else {}
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            **keep,
        ).logits
    from transformers.masking_utils import create_causal_mask

    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    mask = create_causal_mask(
        config=inner.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache, position_ids=position_ids
    )
    rotary = inner.rotary_emb(hidden, position_ids=position_ids)
    for layer in inner.layers[: inner.config.num_hidden_layers]:
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_embeddings=rotary,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
    hidden = inner.norm(hidden)
    return model.lm_head(hidden[:, -1:, :] if last_only else hidden)


def lean_supported(model: Any) -> bool:
    """Whether ``causal_lm_logits`` may run ``model``'s forward itself (see the module)."""
    inner = getattr(model, "model", None)
    if type(model).__name__ not in LEAN_MODELS or inner is None or model.training:
        return False
    if getattr(inner, "has_sliding_layers", False) or getattr(inner, "gradient_checkpointing", False):
        return False
    config = inner.config
    if any(getattr(config, flag, False) for flag in ("output_attentions", "output_hidden_states")):
        return False
    return _layer_takes_cache(type(inner.layers[0]))


@cache
def _layer_takes_cache(layer_class: type) -> bool:
    """The installed library's decoder layer takes ``cache=`` and ``position_embeddings=``."""
    parameters = inspect.signature(layer_class.forward).parameters
    return {"cache", "position_embeddings", "position_ids", "attention_mask"} <= set(parameters)

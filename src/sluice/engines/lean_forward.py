"""The inference engine's forwards without transformers' per-call wrappers.

A decode step of a small model is dispatch, not arithmetic: on the default task's model a
forward of 8 rows costs ≈ 2–3 ms, most of it Python and kernel launches around a few
microseconds of matmuls. For the causal LMs whose model forward is exactly embed →
``create_causal_mask`` → rotary → layers → norm → ``lm_head`` (Llama, and Qwen2 without
sliding-window layers), ``causal_lm_logits`` calls the same mask and rotary functions and then
runs each decoder layer's arithmetic itself (``_decoder_layer``): the same linear layers, the
library's attention function, ``torch.rms_norm`` for the RMSNorm modules (one kernel instead of
six: the same bits in float32) and the rotary formula of ``apply_rotary_pos_emb``, without the
module calls, kwarg shims and output records around them. Every bit is the library's
(``tests/unit/test_lean_forward.py`` compares logits and caches bit for bit); a model in another
dtype, with another attention implementation or with module hooks calls its layers as modules,
and any other model runs its own forward.

Not here: training forwards (autograd, activation checkpointing and FSDP hooks live in the
library's forward, and the trainer keeps it), the KV cache (the caller's), sampling.
"""

from __future__ import annotations

import inspect
import weakref
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
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
    layers = inner.layers[: inner.config.num_hidden_layers]
    if _direct_layers(model) and hidden.dtype == torch.float32:
        cos, sin = (t.unsqueeze(1) for t in rotary)  # apply_rotary_pos_emb's unsqueeze_dim=1
        for layer in layers:
            hidden = _decoder_layer(layer, hidden, mask, cos, sin, cache)
        hidden = _rms_norm(inner.norm, hidden)
    else:
        for layer in layers:
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


def _decoder_layer(layer: Any, hidden: Tensor, mask: Tensor | None, cos: Tensor, sin: Tensor, cache: Any) -> Tensor:
    """``LlamaDecoderLayer`` / ``Qwen2DecoderLayer.forward`` (eval, sdpa, float32, no sliding
    window), op for op: norm, q/k/v projections, rotary, cache update, the library's sdpa
    attention, output projection, residual; norm, gated MLP, residual."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attn, mlp = layer.self_attn, layer.mlp
    rows, length = hidden.shape[:2]
    heads = (rows, length, -1, attn.head_dim)
    x = _rms_norm(layer.input_layernorm, hidden)
    q = _linear(attn.q_proj, x).view(heads).transpose(1, 2)
    k = _linear(attn.k_proj, x).view(heads).transpose(1, 2)
    v = _linear(attn.v_proj, x).view(heads).transpose(1, 2)
    k, v = cache.update(_rotate(k, cos, sin), v, attn.layer_idx)
    out, _ = sdpa_attention_forward(attn, _rotate(q, cos, sin), k, v, mask, dropout=0.0, scaling=attn.scaling)
    hidden = hidden + _linear(attn.o_proj, out.reshape(rows, length, -1))
    x = _rms_norm(layer.post_attention_layernorm, hidden)
    return hidden + _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))


def _linear(module: Any, x: Tensor) -> Tensor:
    return F.linear(x, module.weight, module.bias)


def _rms_norm(norm: Any, hidden: Tensor) -> Tensor:
    """``LlamaRMSNorm`` / ``Qwen2RMSNorm`` of a float32 input: ``weight * (h * rsqrt(mean(h²) + eps))``."""
    return torch.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` (``apply_rotary_pos_emb`` for one tensor)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


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


DIRECT_LAYERS = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer"})
"""Decoder layers whose forward ``_decoder_layer`` repeats op for op (transformers 5)."""
NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm"})
_direct: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _direct_layers(model: Any) -> bool:
    """Whether ``_decoder_layer`` may run ``model``'s layers: the known layer and norm classes,
    the sdpa attention, no sliding window, and no hooks on any module (checked once per model:
    the engine owns its model and adds none)."""
    if model not in _direct:
        inner = model.model
        layers = list(inner.layers)
        norms = [inner.norm, *(n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm))]
        _direct[model] = (
            inner.config._attn_implementation == "sdpa"
            and all(type(layer).__name__ in DIRECT_LAYERS for layer in layers)
            and all(type(norm).__name__ in NORMS for norm in norms)
            and all(getattr(layer.self_attn, "sliding_window", None) is None for layer in layers)
            and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        )
    return _direct[model]


@cache
def _layer_takes_cache(layer_class: type) -> bool:
    """The installed library's decoder layer takes ``cache=`` and ``position_embeddings=``."""
    parameters = inspect.signature(layer_class.forward).parameters
    return {"cache", "position_embeddings", "position_ids", "attention_mask"} <= set(parameters)

"""The engine's lean forward is the library's forward, bit for bit: prefill (left-padded rows,
last position only) then decode steps over the same cache, for Llama and Qwen2; any other model
(or a training one) runs the library's own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from sluice.engines.lean_forward import _direct_layers, causal_lm_logits, lean_supported

SIZES = {"vocab_size": 32, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SIZES, **HEADS)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**SIZES, **HEADS)).eval()


def _library(model, ids, mask, positions, cache, last_only):
    keep = {"logits_to_keep": 1} if last_only else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, **keep)
    return out.logits


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@torch.no_grad()
def test_prefill_and_decode_equal_the_librarys_forward_bit_for_bit(kind):
    model = _model(kind)
    assert lean_supported(model) and _direct_layers(model)  # each layer's arithmetic run directly
    lengths = [5, 9, 7]
    width = max(lengths)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    ids = torch.randint(1, 32, (3, width)) * mask
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    caches, logits = [], []
    for forward in (_library, causal_lm_logits):
        cache = DynamicCache()
        steps = [forward(model, ids, mask, positions, cache, True)]
        last, pos, cols = steps[0][:, -1].argmax(-1), positions[:, -1], mask
        for _ in range(4):  # greedy decode over the same cache
            pos, cols = pos + 1, torch.cat([cols, torch.ones(3, 1, dtype=cols.dtype)], dim=1)
            steps.append(forward(model, last.unsqueeze(1), cols, pos.unsqueeze(1), cache, False))
            last = steps[-1][:, -1].argmax(-1)
        caches.append(cache)
        logits.append(steps)
    for library, lean in zip(*logits, strict=True):
        assert library.shape == lean.shape and torch.equal(library, lean)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_other_models_and_training_run_the_librarys_forward():
    model = _model("llama")
    assert not lean_supported(model.train())
    model.eval()
    model.config.output_hidden_states = True
    assert not lean_supported(model)
    model.config.output_hidden_states = False
    assert lean_supported(model)
    wrapped = torch.nn.Sequential()  # any other class: its own forward
    assert not lean_supported(wrapped)


def test_layers_with_hooks_or_another_attention_run_as_modules():
    hooked = _model("llama")
    seen: list[int] = []
    hooked.model.layers[0].mlp.register_forward_hook(lambda *_: seen.append(1))
    assert lean_supported(hooked) and not _direct_layers(hooked)
    eager = _model("llama")
    eager.config._attn_implementation = "eager"
    assert lean_supported(eager) and not _direct_layers(eager)
    with torch.no_grad():
        causal_lm_logits(hooked, torch.tensor([[1, 2, 3]]), None, torch.tensor([[0, 1, 2]]), DynamicCache(), True)
    assert seen == [1]  # the hook ran: the layers were called as modules

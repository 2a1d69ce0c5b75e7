"""Builders for the embedded default: a character tokenizer and a tiny Llama from a config.

Both are ordinary Hugging Face artefacts (``tokenizer.json`` + ``PreTrainedTokenizerFast``,
``LlamaForCausalLM``), saved with ``save_pretrained`` so the default run loads its base model
exactly the way a user's own model folder is loaded. No training happens here
(``tasks/warm_start.py`` does the SFT).
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sluice.tasks.spec import TinyLlamaSpec

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


def build_char_tokenizer(alphabet: str, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` plus ``<pad> <bos> <eos> <unk>``; prompts get ``<bos>``.
    ``chat_template`` (e.g. ``rollout.envs.TINY_CHAT_TEMPLATE``, the multi-turn tasks' turn format)
    is set on the tokenizer; the built-in tasks' saved tokenizers have none, so their prompts stay
    untemplated."""
    chars = sorted(set(alphabet))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def build_tiny_llama(spec: TinyLlamaSpec, tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` (tied embeddings, no biases) for ``tokenizer``."""
    vocab = -(-len(tokenizer) // 8) * 8
    config = LlamaConfig(
        vocab_size=vocab,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **asdict(spec),
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)

"""Tiny real models for tests (not fakes): a random Llama for engine and trainer tests, and a
random model with the default task's tokenizer plus run overrides for end-to-end runs."""

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 32


def tiny_llama(seed: int = 0, vocab: int = VOCAB) -> LlamaForCausalLM:
    """2 layers, hidden 64, GQA 4/2 heads, tied embeddings, fp32, eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).float().eval()


def save_tiny_task_model(path: Path, head_dim: int = 8, seed: int = 0) -> Path:
    """A random tiny Llama with the default task's character tokenizer, saved as an HF folder.
    ``head_dim=64`` gives a shape vLLM's CPU attention kernels accept (hidden 128, 2 heads)."""
    from sluice.tasks import TASKS
    from sluice.tasks.spec import TinyLlamaSpec
    from sluice.tasks.tiny_model import build_char_tokenizer, build_tiny_llama

    tok = build_char_tokenizer(TASKS["reverse_digits"].alphabet)
    heads = 4 if head_dim == 8 else 2
    spec = TinyLlamaSpec(hidden_size=heads * head_dim, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=2 if heads == 4 else 1, intermediate_size=2 * heads * head_dim,
                         max_position_embeddings=64 if head_dim == 8 else 256)  # fmt: skip
    build_tiny_llama(spec, tok, seed=seed).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tiny_run_overrides(model_dir: Path, out: Path, name: str) -> list[str]:
    """Config overrides for a 3-step run of 4 groups × 4 samples on ``save_tiny_task_model``
    (no ``plot.png``: a test that checks it sets ``tracking.plot=true``)."""
    return [
        f"model.path={model_dir}",
        "task.train_prompts=64",
        "task.eval_prompts=16",
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
        "trainer.lr=3e-3",
        "run.steps=3",
        "run.threads=1",
        "run.progress=false",
        "tracking.plot=false",  # matplotlib's figure costs ~1 s a run; the tests of plot.png ask for it
        f"run.output_dir={out}",
        f"run.name={name}",
    ]


TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'system' %}-{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)
"""A chat template the default task's character tokenizer can spell: the system message, ``-``,
the user turns, and ``>`` as the generation prompt (``"9-12>"`` for system 9, user 12)."""


def add_chat_template(model_dir: Path, out: Path) -> Path:
    """A copy of the HF folder ``model_dir`` whose tokenizer has ``TINY_CHAT_TEMPLATE``."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(model_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out


CHAT_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 <>.?!"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}"
    "{{ eos_token if m['role'] == 'assistant' else '' }}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)
"""A tiny chat format: a turn is ``<r>content`` (``r`` the role's initial), an assistant turn closes
with ``<eos>``, the generation prompt is ``<a>``."""


def chat_tokenizer(template: str | None = CHAT_TEMPLATE):
    """A character tokenizer over ``CHAT_ALPHABET`` with ``template`` as its chat template."""
    from sluice.tasks.tiny_model import build_char_tokenizer

    return build_char_tokenizer(CHAT_ALPHABET, chat_template=template)


def save_chat_model(path: Path) -> Path:
    """A random tiny Llama (hidden 32, 2 layers, 64 positions) with ``chat_tokenizer()``, saved."""
    from sluice.tasks.spec import TinyLlamaSpec
    from sluice.tasks.tiny_model import build_tiny_llama

    tok = chat_tokenizer()
    spec = TinyLlamaSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    build_tiny_llama(spec, tok, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def save_tiny_reward_model(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """``model_dir``'s trunk with a seeded random scalar head (what ``sluice rm`` starts from),
    saved as a reward model folder ``reward.model`` takes."""
    from transformers import AutoTokenizer

    from sluice.engines.hf_model import load_scalar_model

    torch.manual_seed(seed)
    model = load_scalar_model(model_dir, field="model.path", new_head=True)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores spread well apart
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out

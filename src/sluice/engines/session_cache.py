"""Multi-turn prefix reuse for the built-in engine: a finished turn's KV cache, kept for its episode's next turn.

A request may name its ``session`` (one multi-turn episode: ``GenerationRequest.session``). When
such a row finishes, the engine keeps its keys / values here (its prompt plus every generated token
but the last, which was never fed). When the session's next request arrives under the same
weights and its prompt extends exactly those tokens, ``continue_prefill`` computes only the new
tokens (the last answer token and the observation) over the kept cache instead of prefilling the
whole history again; whatever does not match is prefilled in full as before. Entries leave when
taken, least recently kept first once they exceed ``max_bytes`` (a kept turn is a view of the one
copy its finishing batch made), and all at once when the engine loads new weights, unless its
running rows keep their older caches too (``reprefill=False``, PipelineRL), where a kept turn is
treated like a running row.

Not here: scheduling, sampling and the running rows' slab (``hf_inference.py``, ``kv_batch.py``),
and prefix sharing across sessions (the samples of one prompt share their first prefill already).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from sluice.engines.kv_batch import Rows
from sluice.engines.lean_forward import causal_lm_logits


@dataclass(frozen=True)
class KeptTurn:
    """One session's cache: ``tokens`` held in it; ``kv`` every layer's keys then values
    [kv_heads, cols, head_dim] over ``mask`` [cols] (1 where a column holds one of ``tokens``)."""

    tokens: tuple[int, ...]
    kv: tuple[Tensor, ...]
    mask: Tensor

    @functools.cached_property
    def nbytes(self) -> int:  # asked on every keep, eviction and take: computed once
        return sum(t.numel() * t.element_size() for t in self.kv)


class SessionCache:
    """Kept turns by session, least recently kept dropped first past ``max_bytes`` (see the module
    docstring). Counts ``session_kept``, ``session_hits``, ``session_hit_tokens`` (tokens not
    computed again) and ``session_dropped`` (evicted or cleared unused)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._turns: OrderedDict[str, KeptTurn] = OrderedDict()
        self._bytes = 0
        self.counts = dict.fromkeys(("session_kept", "session_hits", "session_hit_tokens", "session_dropped"), 0)

    def __len__(self) -> int:
        return len(self._turns)

    def keep(self, session: str, turn: KeptTurn) -> None:
        if turn.nbytes > self.max_bytes:
            return
        self._pop(session)
        self._turns[session] = turn
        self._bytes += turn.nbytes
        self.counts["session_kept"] += 1
        while self._bytes > self.max_bytes:
            self._pop(next(iter(self._turns)))
            self.counts["session_dropped"] += 1

    def keep_rows(self, rows: Rows, ends: Iterable[tuple[int, list[int], int]], version: int | None) -> None:
        """Keep the finishing rows ``ends`` (row, generated tokens, their count) of a running batch
        whose request names a session and, unless ``version`` is None, whose cache that version
        computed. A kept turn holds the prompt and every generated token but the last, and only
        its own columns (from its first token; pad columns inside it, left by ``continue_prefill``,
        are dropped), so a later turn is not as wide as the batch it left."""
        seqs = rows.seqs
        keep = [
            (i, tuple(tokens[: n - 1]))
            for i, tokens, n in ends
            if seqs[i].request.session and (version is None or seqs[i].version == version)
        ]
        if not keep:
            return
        at = torch.tensor([i for i, _ in keep], device=rows.mask.device)
        kv = [layer.keys.index_select(0, at) for layer in rows.cache.layers]
        kv += [layer.values.index_select(0, at) for layer in rows.cache.layers]
        mask = rows.mask.index_select(0, at)
        starts = mask.argmax(1)
        first, whole = starts.tolist(), (mask.sum(1) == mask.shape[1] - starts).tolist()
        for j, (i, gen) in enumerate(keep):
            if whole[j]:
                turn_kv, turn_mask = tuple(t[j, :, first[j] :] for t in kv), mask[j, first[j] :]
            else:
                cols = mask[j].nonzero().squeeze(1)
                turn_kv, turn_mask = tuple(t[j].index_select(1, cols) for t in kv), mask[j, cols]
            request = seqs[i].request
            self.keep(request.session, KeptTurn(tuple(request.prompt_ids) + gen, turn_kv, turn_mask))

    def take(self, session: str | None, prompt: tuple[int, ...]) -> KeptTurn | None:
        """``session``'s kept turn if ``prompt`` strictly extends its tokens (it leaves either way)."""
        turn = self._pop(session) if session is not None else None
        if turn is None or len(prompt) <= len(turn.tokens) or prompt[: len(turn.tokens)] != turn.tokens:
            return None
        self.counts["session_hits"] += 1
        self.counts["session_hit_tokens"] += len(turn.tokens)
        return turn

    def clear(self) -> None:
        self.counts["session_dropped"] += len(self._turns)
        self._turns.clear()
        self._bytes = 0

    def _pop(self, session: str) -> KeptTurn | None:
        turn = self._turns.pop(session, None)
        if turn is not None:
            self._bytes -= turn.nbytes
        return turn


def continue_prefill(
    model: PreTrainedModel, turns: Sequence[KeptTurn], prompts: Sequence[tuple[int, ...]]
) -> tuple[DynamicCache, Tensor, Tensor, int]:
    """One forward over each prompt's tokens past its kept turn, attending to that turn's cache.

    Kept caches are right-aligned into one past [rows, kv_heads, P, head_dim]; the new tokens are
    left-padded to the longest; positions continue from each kept length. Returns what
    ``kv_batch.prefill`` returns: the cache (with the pad columns between past and new tokens
    masked), its mask [rows, P + N], the logits after each prompt [rows, V], tokens computed.
    """
    layers = len(turns[0].kv) // 2
    past_cols = max(t.mask.shape[0] for t in turns)
    suffixes = [p[len(t.tokens) :] for t, p in zip(turns, prompts, strict=True)]
    width = max(map(len, suffixes))
    device = turns[0].mask.device
    cache = DynamicCache()
    for layer in range(layers):
        keys, values = (
            torch.stack([F.pad(t.kv[layer + half], (0, 0, past_cols - t.mask.shape[0], 0)) for t in turns])
            for half in (0, layers)
        )
        cache.update(keys, values, layer)
    past_mask = torch.stack([F.pad(t.mask, (past_cols - t.mask.shape[0], 0)) for t in turns])
    ids = torch.tensor([[0] * (width - len(s)) + list(s) for s in suffixes], dtype=torch.long, device=device)
    new_mask = torch.tensor(
        [[0] * (width - len(s)) + [1] * len(s) for s in suffixes], dtype=past_mask.dtype, device=device
    )
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # each row's last position + 1
    positions = (lengths.unsqueeze(1) - width + torch.arange(width, device=device)).clamp(min=0)
    mask = torch.cat([past_mask, new_mask], dim=1)
    logits = causal_lm_logits(model, ids, mask, positions, cache, last_only=True)
    return cache, mask, logits[:, -1], sum(map(len, suffixes))

"""Row-aligned batch state over one right-aligned KV cache, and the prefill that builds it.

``Rows`` holds everything the built-in engine tracks per running sequence (row ``i`` is
``seqs[i]``): the shared ``DynamicCache``, a 2-D mask of valid columns, the next token to feed,
position ids, sampling parameters, and the generated tokens / log-probs / versions so far. Rows
leave by ``select`` (``index_select``, dropping leading columns nobody uses) and join by
``extend`` (left-padding the shorter side with masked zero columns). ``prefill`` runs each
distinct token sequence once (equal lengths share one unpadded forward) and returns a cache whose
rows follow the input order; the engine uses it for new prompts and, after an interrupting weight
update, to rebuild the cache of running rows (prompt + tokens so far) under the new weights.

Not here: scheduling, sampling and weight updates (``hf_inference.py``, ``sampling.py``); paged
KV and sliding-window caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from sluice.api.types import SamplingParams


def _map_kv(cache: DynamicCache, fn: Any) -> None:
    """Replace every layer's keys and values [rows, kv_heads, cols, head_dim] by ``fn(tensor)``."""
    for layer in cache.layers:
        for attr in ("keys", "values"):
            setattr(layer, attr, fn(getattr(layer, attr)))


@dataclass
class Rows:
    """Row-aligned state of sequences sharing one right-aligned KV cache (row i is seqs[i])."""

    seqs: list[Any]
    cache: DynamicCache  # per layer keys / values [rows, kv_heads, cols, head_dim]
    mask: Tensor  # [rows, cols] 1 where the column holds one of the row's tokens
    last: Tensor  # [rows] token to feed next
    pos: Tensor  # [rows] position id of `last` (= the row's tokens in the cache)
    key: Tensor  # [rows] hash key from the request seed
    ngen: Tensor  # [rows] tokens generated so far
    max_new: Tensor  # [rows]
    temp: Tensor  # [rows]
    top_p: Tensor  # [rows]
    stop: Tensor  # [rows, stops] stop token ids, -1 padded
    out_tok: Tensor  # [rows, width] generated tokens
    out_lp: Tensor  # [rows, width] their log-probs
    out_ver: Tensor  # [rows, width] their policy versions

    _PER_ROW = ("last", "pos", "key", "ngen", "max_new", "temp", "top_p")
    _PADDED = (("stop", -1), ("out_tok", 0), ("out_lp", 0.0), ("out_ver", 0))

    @classmethod
    def start(
        cls, seqs: list[Any], params: list[SamplingParams], keys: list[int], cache: DynamicCache, mask: Tensor
    ) -> Rows:
        """Fresh rows whose prompts fill ``cache`` / ``mask`` [rows, cols]; nothing generated yet."""
        n, device = len(seqs), mask.device
        stops = max(1, *(len(p.stop_token_ids) for p in params))
        width = max(p.max_new_tokens for p in params)

        def new(values: Any, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            seqs=list(seqs),
            cache=cache,
            mask=mask,
            last=new([0] * n),
            pos=mask.sum(1),
            key=new(keys),
            ngen=new([0] * n),
            max_new=new([p.max_new_tokens for p in params]),
            temp=new([p.temperature for p in params], torch.float32),
            top_p=new([p.top_p for p in params], torch.float64),
            stop=new([[*p.stop_token_ids, *[-1] * (stops - len(p.stop_token_ids))] for p in params]),
            out_tok=new([[0] * width] * n),
            out_lp=new([[0.0] * width] * n, torch.float32),
            out_ver=new([[0] * width] * n),
        )

    def cached_tokens(self, prompts: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Each row's tokens held in the cache: its prompt plus all generated tokens but ``last``."""
        generated, counts = self.out_tok.tolist(), self.ngen.tolist()
        return [tuple(p) + tuple(g[: n - 1]) for p, g, n in zip(prompts, generated, counts, strict=True)]

    def select(self, idx: Tensor) -> Rows:
        """Keep rows ``idx`` [kept] and drop leading columns no kept row uses."""
        self.seqs = [self.seqs[i] for i in idx.tolist()]
        mask = self.mask.index_select(0, idx)
        first = int(mask.any(0).to(torch.int8).argmax())
        self.mask = mask[:, first:]
        _map_kv(self.cache, lambda t: t[:, :, first:].index_select(0, idx))
        for name in self._PER_ROW + tuple(n for n, _ in self._PADDED):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        return self

    def extend(self, other: Rows) -> Rows:
        """Append ``other``'s rows, left-padding the shorter cache with masked zero columns."""
        cols = max(self.mask.shape[1], other.mask.shape[1])
        self.seqs = self.seqs + other.seqs
        self.mask = torch.cat([F.pad(m, (cols - m.shape[1], 0)) for m in (self.mask, other.mask)])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            for attr in ("keys", "values"):
                pair = (getattr(mine, attr), getattr(theirs, attr))
                setattr(mine, attr, torch.cat([F.pad(t, (0, 0, cols - t.shape[2], 0)) for t in pair]))
        for name in self._PER_ROW:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        for name, fill in self._PADDED:
            a, b = getattr(self, name), getattr(other, name)
            width = max(a.shape[1], b.shape[1])
            setattr(self, name, torch.cat([F.pad(t, (0, width - t.shape[1]), value=fill) for t in (a, b)]))
        return self


def prefill(model: PreTrainedModel, sequences: Sequence[tuple[int, ...]]) -> tuple[DynamicCache, Tensor, Tensor, int]:
    """Run each distinct sequence once; equal lengths share one unpadded forward.

    Returns ``(cache, mask, logits, computed)``: a right-aligned cache with one row per input
    sequence (input order; keys / values [rows, kv_heads, cols, head_dim]), its mask [rows, cols],
    the logits after each sequence's last token [rows, V], and the number of tokens computed.
    """
    device = next(model.parameters()).device
    distinct = list(dict.fromkeys(tuple(s) for s in sequences))
    caches: list[DynamicCache] = []
    logits: list[Tensor] = []
    order: list[tuple[int, ...]] = []
    for length in sorted({len(s) for s in distinct}):
        group = [s for s in distinct if len(s) == length]
        ids = torch.tensor(group, dtype=torch.long, device=device)  # [group, length]
        positions = torch.arange(length, device=device).expand(len(group), length)
        cache = DynamicCache()
        out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
        caches.append(cache)
        logits.append(out.logits[:, -1])
        order.extend(group)
    cols = len(order[-1])
    merged = caches[0]
    for i, layer in enumerate(merged.layers):
        for attr in ("keys", "values"):
            parts = [getattr(c.layers[i], attr) for c in caches]
            setattr(layer, attr, torch.cat([F.pad(t, (0, 0, cols - t.shape[2], 0)) for t in parts]))
    mask = torch.tensor([[0] * (cols - len(s)) + [1] * len(s) for s in order], dtype=torch.long, device=device)
    row_of = {s: i for i, s in enumerate(order)}
    share = torch.tensor([row_of[tuple(s)] for s in sequences], device=device)
    _map_kv(merged, lambda t: t.index_select(0, share))
    return merged, mask.index_select(0, share), torch.cat(logits).index_select(0, share), sum(map(len, distinct))

"""Row-aligned batch state over one right-aligned KV cache, and the prefill that builds it.

``Rows`` holds everything the built-in engine tracks per running sequence (row ``i`` is
``seqs[i]``): the KV cache and a 2-D mask of valid columns (both in a preallocated ``Slab`` with
spare rows and columns, read by the model through a ``DynamicCache`` of ``_SlabLayer`` views), the
next token to feed, position ids, sampling parameters, and the generated tokens / log-probs /
versions so far. A decode step writes its column in place; rows leave by ``select`` (the last rows
move into freed slots, leading columns nobody uses are dropped by moving an offset) and join by
``extend`` (written into free slots, right-aligned). Why: with ``DynamicCache`` concatenation and
``index_select`` every step copied the whole cache, which made continuous batching (rows leave and
join all the time) slower than static batches. ``prefill`` runs each distinct token sequence
once (prompts of different lengths share one left-padded forward, ``prefill_plan``) and returns a
plain cache whose rows follow the input order; the engine uses it for new prompts and, after an
interrupting weight update, to rebuild the cache of running rows (prompt + tokens so far) under
the new weights.

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
from transformers.cache_utils import DynamicLayer

from sluice.api.types import SamplingParams
from sluice.engines.lean_forward import causal_lm_logits
from sluice.engines.response_tokens import buckets_of

_ROOM = 32  # spare columns per (re)allocation of the slab


def _cols(buf: Tensor, a: int, b: int) -> Tensor:
    """Columns ``a:b`` of a KV buffer [rows, kv_heads, cols, head_dim] or a mask [rows, cols]."""
    return buf.narrow(2 if buf.dim() == 4 else 1, a, b - a)


class Slab:
    """Preallocated keys / values of every layer plus the mask, with spare rows and columns; rows
    ``:n`` hold columns ``start:end``. Why: ``DynamicCache`` concatenates (copies the whole cache) on
    every decode step, and rows leaving or joining copied it again; on a small model those copies
    cost more than the forward. Here a decode step writes one column in place, a leaving row's slot
    takes the last row (copying only moved rows), joining rows go into free slots, and trimming
    columns nobody uses only moves ``start``. Buffers are zero-initialised and only ever hold
    finite values, so masked columns contribute exactly nothing to attention."""

    def __init__(self, tensors: list[Tensor], rows: int, spare: Slab | None = None) -> None:
        n, cols = tensors[-1].shape
        self.n, self.start, self.end = n, 0, cols
        need = (max(rows, n), cols + _ROOM)
        if spare is not None and spare.fits(tensors, *need):  # no fresh zeroed pages per wave
            self.bufs = spare.bufs
        else:
            self.bufs = [self._alloc(t, *need) for t in tensors]
        for buf, t in zip(self.bufs, tensors, strict=True):
            _cols(buf, 0, cols)[:n].copy_(t)

    def fits(self, tensors: list[Tensor], rows: int, cols: int) -> bool:
        """Whether these buffers can hold a new slab of ``tensors`` with ``rows`` × ``cols`` room.
        A slab nobody reads any more is reused as is: its stale rows and columns are never read
        before they are written (the first columns by ``__init__``, later ones by a decode step,
        exposed ones zeroed by ``reserve``, joining rows' by ``Rows.extend``), so a reused slab
        computes the same bits as fresh zeros. Why: a wave's new slab of fresh zeroed memory
        (~50 MB at 256 rows) cost page faults every sync step."""
        if len(tensors) != len(self.bufs) or rows > self.bufs[-1].shape[0] or cols > self.bufs[-1].shape[-1]:
            return False
        same = (b.dtype == t.dtype and b.device == t.device for b, t in zip(self.bufs, tensors, strict=True))
        pairs = zip(self.bufs[:-1], tensors[:-1], strict=True)
        kv = (b.shape[1:-2] == t.shape[1:-2] and b.shape[-1] == t.shape[-1] for b, t in pairs)
        return all(same) and all(kv)

    @staticmethod
    def _alloc(like: Tensor, rows: int, cols: int) -> Tensor:
        shape = (rows, *like.shape[1:-2], cols, like.shape[-1]) if like.dim() == 4 else (rows, cols)
        return torch.zeros(shape, dtype=like.dtype, device=like.device)

    def view(self, i: int, extra: int = 0) -> Tensor:
        return _cols(self.bufs[i], self.start, self.end + extra)[: self.n]

    def reserve(self, rows: int, width: int, room: int) -> None:
        """Room for ``rows`` rows, ``width`` columns ending at ``end``, and ``room`` columns after it;
        reallocates (one copy) only when the spare rows / columns run out, then with spare rows
        (half again), columns before (a quarter of the width) and after (the width): decode steps
        add a column each and rows join and leave all the time, so a copy is paid rarely."""
        cols, (cap_rows, cap_cols) = self.end - self.start, self.bufs[-1].shape
        grow = max(0, width - cols)
        if rows <= cap_rows and grow <= self.start and self.end + room <= cap_cols:
            if grow:  # the slots' columns left of `start` hold stale data of rows gone
                for buf in self.bufs:
                    _cols(buf, self.start - grow, self.start)[: self.n].zero_()
                self.start -= grow
            return
        width = max(width, cols)
        lead, rows = width // 4, rows if rows <= cap_rows else max(rows, cap_rows + cap_rows // 2)
        new = [self._alloc(b, max(rows, cap_rows), lead + width + max(room, _ROOM, width)) for b in self.bufs]
        for old, buf in zip(self.bufs, new, strict=True):
            _cols(buf, lead + width - cols, lead + width)[: self.n].copy_(_cols(old, self.start, self.end)[: self.n])
        self.bufs, self.start, self.end = new, lead, lead + width


class _SlabLayer(DynamicLayer):
    """One layer's view of a ``Slab``: ``update`` writes the new column(s) in place after ``end``
    (the engine reserved them) and returns views; the engine advances ``end`` after the forward."""

    def __init__(self, slab: Slab, k: int, v: int) -> None:  # no super(): keys / values are views
        self.slab, self.kv, self.is_initialized = slab, (k, v), True

    @property
    def keys(self) -> Tensor:  # type: ignore[override]
        return self.slab.view(self.kv[0])

    @property
    def values(self) -> Tensor:  # type: ignore[override]
        return self.slab.view(self.kv[1])

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        s, add = self.slab, key_states.shape[2]
        s.reserve(s.n, 0, add)
        for i, new in zip(self.kv, (key_states, value_states), strict=True):
            _cols(s.bufs[i], s.end, s.end + add)[: s.n].copy_(new)
        return s.view(self.kv[0], add), s.view(self.kv[1], add)

    def get_seq_length(self) -> int:
        return self.slab.end - self.slab.start


def _to_slab(cache: DynamicCache, mask: Tensor, rows: int, spare: Slab | None = None) -> tuple[DynamicCache, Slab]:
    """Copy a plain (prefill) cache into a new slab with ``rows`` row slots (in ``spare`` 's buffers
    when they fit); a cache reading it."""
    layers = len(cache.layers)
    slab = Slab([*(c.keys for c in cache.layers), *(c.values for c in cache.layers), mask], rows, spare)
    cache.layers = [_SlabLayer(slab, i, layers + i) for i in range(layers)]
    return cache, slab


@dataclass
class Rows:
    """Row-aligned state of sequences sharing one right-aligned KV cache (row i is seqs[i])."""

    seqs: list[Any]
    cache: DynamicCache  # per layer keys / values [rows, kv_heads, cols, head_dim], views of `slab`
    slab: Slab
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
        cls,
        seqs: list[Any],
        params: list[SamplingParams],
        keys: list[int],
        cache: DynamicCache,
        mask: Tensor,
        spare: Slab | None = None,
    ) -> Rows:
        """Fresh rows whose prompts fill ``cache`` / ``mask`` [rows, cols]; nothing generated yet.
        ``spare``: the slab of rows no longer running, reused when it fits (``Slab.fits``)."""
        n, device = len(seqs), mask.device
        stops = max(1, *(len(p.stop_token_ids) for p in params))
        width = max(p.max_new_tokens for p in params)

        def new(values: Any, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            seqs=list(seqs),
            **dict(zip(("cache", "slab"), _to_slab(cache, mask, n, spare), strict=True)),
            last=new([0] * n),
            pos=mask.sum(1),
            key=new(keys),
            ngen=new([0] * n),
            max_new=new([p.max_new_tokens for p in params]),
            temp=new([p.temperature for p in params], torch.float32),
            top_p=new([p.top_p for p in params], torch.float64),
            stop=new([[*p.stop_token_ids, *[-1] * (stops - len(p.stop_token_ids))] for p in params]),
            out_tok=torch.zeros((n, width), dtype=torch.long, device=device),
            out_lp=torch.zeros((n, width), dtype=torch.float32, device=device),
            out_ver=torch.zeros((n, width), dtype=torch.long, device=device),
        )

    @property
    def mask(self) -> Tensor:
        """[rows, cols] 1 where the column holds one of the row's tokens."""
        return self.slab.view(-1)

    def replace_cache(self, cache: DynamicCache, mask: Tensor) -> None:
        """Use a rebuilt (re-prefilled) plain cache for the same rows, in the same order."""
        self.cache, self.slab = _to_slab(cache, mask, self.slab.bufs[-1].shape[0])

    def open_column(self) -> Tensor:
        """Reserve the column a decode step fills and return the mask [rows, cols + 1] including it."""
        s = self.slab
        s.reserve(s.n, 0, 1)
        _cols(s.bufs[-1], s.end, s.end + 1)[: s.n] = 1
        return s.view(-1, 1)

    def close_column(self) -> None:
        """After the decode forward wrote the reserved column into every layer."""
        self.slab.end += 1

    def cached_tokens(self, prompts: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Each row's tokens held in the cache: its prompt plus all generated tokens but ``last``."""
        generated, counts = self.out_tok.tolist(), self.ngen.tolist()
        return [tuple(p) + tuple(g[: n - 1]) for p, g, n in zip(prompts, generated, counts, strict=True)]

    def select(self, keep: list[int]) -> Rows:
        """Keep rows ``keep`` (ascending): each freed slot below ``len(keep)`` takes a kept row from
        above it, so only moved rows are copied (row order changes); then drop leading columns no
        kept row uses."""
        s, n = self.slab, len(keep)
        kept = set(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in keep if i >= n]
        order = list(range(n))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        if holes:
            dst, src = (torch.tensor(x, device=s.bufs[0].device) for x in (holes, movers))
            for buf in s.bufs:
                part = _cols(buf, s.start, s.end)
                part.index_copy_(0, dst, part.index_select(0, src))
        self.seqs = [self.seqs[i] for i in order]
        s.n = n
        s.start += int(self.mask.any(0).to(torch.int8).argmax())
        idx = torch.tensor(order, device=s.bufs[0].device)
        for name in self._PER_ROW + tuple(name for name, _ in self._PADDED):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        return self

    def extend(self, other: Rows) -> Rows:
        """Append ``other``'s rows into free slots (right-aligned; columns left of them masked)."""
        s, o = self.slab, other.slab
        k, width = o.n, o.end - o.start
        s.reserve(s.n + k, width, 1)
        for buf, theirs in zip(s.bufs, o.bufs, strict=True):
            _cols(buf, s.start, s.end)[s.n : s.n + k].zero_()
            _cols(buf, s.end - width, s.end)[s.n : s.n + k].copy_(_cols(theirs, o.start, o.end)[:k])
        s.n += k
        self.seqs = self.seqs + other.seqs
        for name in self._PER_ROW:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        for name, fill in self._PADDED:
            a, b = getattr(self, name), getattr(other, name)
            width = max(a.shape[1], b.shape[1])
            setattr(self, name, torch.cat([F.pad(t, (0, width - t.shape[1]), value=fill) for t in (a, b)]))
        return self


PREFILL_TOKENS = 16384
"""Positions (rows × longest prompt) one prefill forward may take: prompts of different lengths
share a left-padded forward up to this many (``prefill_plan``)."""


def prefill_plan(sequences: Sequence[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """The forwards ``prefill`` runs: each distinct sequence once, length-sorted (ties in first
    appearance), cut where ``rows × longest`` would pass ``PREFILL_TOKENS`` (a longer one alone).
    Why: on a small model a forward costs its per-layer dispatch whatever its rows, so one forward
    per distinct length (the sync step's ~12) cost more than the padding one forward adds."""
    distinct = list(dict.fromkeys(tuple(s) for s in sequences))
    return [[distinct[i] for i in part] for part in buckets_of([len(s) for s in distinct], PREFILL_TOKENS)]


def prefill(
    model: PreTrainedModel, sequences: Sequence[tuple[int, ...]], plan: list[list[tuple[int, ...]]] | None = None
) -> tuple[DynamicCache, Tensor, Tensor, int]:
    """Run each distinct sequence once, in the forwards of ``plan`` (``prefill_plan``'s, computed
    here unless the caller has it; shorter ones left-padded, their pad columns masked, zeroed in
    the cache and given position 0).

    Returns ``(cache, mask, logits, computed)``: a right-aligned cache with one row per input
    sequence (input order; keys / values [rows, kv_heads, cols, head_dim]), its mask [rows, cols],
    the logits after each sequence's last token [rows, V], and the number of tokens computed.
    """
    device = next(model.parameters()).device
    caches: list[DynamicCache] = []
    logits: list[Tensor] = []
    order: list[tuple[int, ...]] = []
    for group in prefill_plan(sequences) if plan is None else plan:
        width = max(map(len, group))
        rows_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in group], device=device)
        ids = torch.tensor([[0] * (width - len(s)) + list(s) for s in group], dtype=torch.long, device=device)
        positions = (rows_mask.cumsum(1) - 1).clamp(min=0)  # [group, width]
        padded = bool((rows_mask == 0).any())
        cache = DynamicCache()
        last = causal_lm_logits(model, ids, rows_mask if padded else None, positions, cache, last_only=True)
        if padded:  # pad columns: masked from now on, and zero like the slab's unused columns
            keep = rows_mask.bool()[:, None, :, None]
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.where(keep, 0.0), layer.values.where(keep, 0.0)
        caches.append(cache)
        logits.append(last[:, -1])
        order.extend(group)
    cols = max(map(len, order))
    merged = caches[0]
    for i, layer in enumerate(merged.layers):
        for attr in ("keys", "values"):
            parts = [getattr(c.layers[i], attr) for c in caches]
            setattr(layer, attr, torch.cat([F.pad(t, (0, 0, cols - t.shape[2], 0)) for t in parts]))
    mask = torch.tensor([[0] * (cols - len(s)) + [1] * len(s) for s in order], dtype=torch.long, device=device)
    row_of = {s: i for i, s in enumerate(order)}
    share = torch.tensor([row_of[tuple(s)] for s in sequences], device=device)
    for layer in merged.layers:
        layer.keys, layer.values = layer.keys.index_select(0, share), layer.values.index_select(0, share)
    return merged, mask.index_select(0, share), torch.cat(logits).index_select(0, share), sum(map(len, order))

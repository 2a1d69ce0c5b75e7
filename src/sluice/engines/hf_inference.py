"""The built-in inference engine: continuous batching over a Hugging Face causal LM in torch.

``HFInferenceEngine`` implements ``InferenceEngine`` for full-attention ``AutoModelForCausalLM``
models (Llama, Qwen2, ...); the default RL loop generates with it on CPU. Each ``step()`` is
deterministic (no clock): drop rows aborted since the last step; admit waiting requests (FIFO) up
to ``max_batch``, prefilling each distinct prompt once (prefix sharing for GRPO groups; equal
lengths share one unpadded forward) and sampling their first token from the prefill logits; then
one decode step for all running rows. The running batch shares one right-aligned ``DynamicCache``
(a 2-D mask marks valid columns; position ids count each row's own tokens): finished rows leave by
``index_select``, new ones join by left-padding the shorter side. Sampling inverts the CDF of
``softmax(logits / T)`` (after top-p) at ``u = hash(seed, token index)``, so a sample's tokens do
not depend on its batch neighbours.

Deliberately not here: paged KV, chunked prefill, speculative decoding, sliding-window caches, and
re-prefill on ``update_weights(mode="interrupt")``: running rows keep their old-weight KV cache and
only new tokens' versions change (re-prefill comes with the rollout work). One engine is one
replica, so ``"staggered"`` acts like ``"defer"``; every mode loads at once, between two steps.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from sluice.api.protocols import WeightUpdateMode
from sluice.api.types import Completion, FinishReason, GenerationRequest
from sluice.engines.hf_model import load_causal_lm

logger = logging.getLogger(__name__)

_U32 = 0xFFFFFFFF
_MODES = ("interrupt", "defer", "staggered")


def _pcg(x: Any) -> Any:
    """PCG hash of uint32 values held in int64 (a Python int or a tensor); result in [0, 2**32)."""
    state = (x * 747796405 + 2891336453) & _U32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _U32
    return ((word >> 22) ^ word) & _U32


def _seed_key(seed: int) -> int:
    """Mix a (possibly negative or > 32-bit) seed into a 32-bit per-sample key."""
    return _pcg(_pcg((seed >> 32) & _U32) ^ (seed & _U32))


def _uniforms(key: Tensor, index: Tensor) -> Tensor:
    """Counter-based uniforms in [0, 1): ``key``, ``index`` [rows] int64 -> [rows] float64."""
    return _pcg((key + _pcg(index)) & _U32).double() * 2.0**-32


def _inverse_cdf(cum: Tensor, u: Tensor) -> Tensor:
    """First index whose cumulative mass exceeds ``u`` times the total: cum [rows, V], u [rows]."""
    return torch.searchsorted(cum, (u * cum[:, -1]).unsqueeze(1), right=True).squeeze(1)


def sample_tokens(logits: Tensor, temperature: Tensor, top_p: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """One token per row: logits [rows, V]; temperature, top_p, u [rows] -> (tokens, log-probs) [rows].

    ``temperature <= 0`` takes the argmax. The log-prob is ``log_softmax(logits / T)`` before top-p.
    Rows with ``top_p < 1`` invert the CDF over tokens sorted by probability, the others over
    vocabulary order; a row's result depends only on its own inputs.
    """
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    probs = logp.double().exp()
    tokens = _inverse_cdf(probs.cumsum(-1), u)
    nucleus = (top_p < 1) & ~greedy
    if bool(nucleus.any()):
        idx = nucleus.nonzero().squeeze(1)
        sorted_p, order = probs[idx].sort(dim=-1, descending=True, stable=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p[idx].double().unsqueeze(1)
        pick = _inverse_cdf(torch.where(keep, sorted_p, 0.0).cumsum(-1), u[idx])  # u < 1: a kept token
        tokens[idx] = order.gather(1, pick.unsqueeze(1)).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)


@dataclass(eq=False)  # compared by identity
class _Seq:
    request: GenerationRequest
    future: Future[Completion]


@dataclass
class _Rows:
    """Row-aligned state of sequences sharing one right-aligned KV cache (row i is seqs[i])."""

    seqs: list[_Seq]
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

    def select(self, idx: Tensor) -> _Rows:
        """Keep rows ``idx`` [kept] and drop leading columns no kept row uses."""
        self.seqs = [self.seqs[i] for i in idx.tolist()]
        mask = self.mask.index_select(0, idx)
        first = int(mask.any(0).to(torch.int8).argmax())
        self.mask = mask[:, first:]
        for layer in self.cache.layers:
            for attr in ("keys", "values"):
                setattr(layer, attr, getattr(layer, attr)[:, :, first:].index_select(0, idx))
        for name in self._PER_ROW + tuple(n for n, _ in self._PADDED):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        return self

    def extend(self, other: _Rows) -> _Rows:
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


class HFInferenceEngine:
    """Continuous-batching generation with a Hugging Face causal LM (see the module docstring)."""

    def __init__(
        self, model: PreTrainedModel, *, max_batch: int = 256, version: int = 0, device: str | None = None
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if device is not None:
            torch.nn.Module.to(model, device)  # in place (transformers' typed `.to` confuses mypy)
        self.model = model.eval()
        self.device = next(self.model.parameters()).device
        self.max_batch = max_batch
        self.version = version
        self._waiting: deque[_Seq] = deque()
        self._rows: _Rows | None = None
        self._by_id: dict[str, _Seq] = {}
        self._abort_ids: set[str] = set()
        self._paused = False
        self._driver: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._counts = {"generated_tokens": 0, "prefill_tokens": 0, "steps": 0}

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> HFInferenceEngine:
        """Load a local HF model folder in float32 (eval mode); ``kwargs`` go to the constructor."""
        return cls(load_causal_lm(path, dtype=torch.float32), **kwargs)

    async def generate(self, request: GenerationRequest) -> Completion:
        """Queue ``request`` and await its completion (cancelling the await aborts it)."""
        future = self.submit(request)
        self._ensure_driver()
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """A waiting request resolves now; a running one at the next step boundary."""
        seq = self._by_id.get(request_id)
        if seq is not None and seq in self._waiting:
            self._waiting.remove(seq)
            self._resolve(seq, [], [], [], "abort")
        elif seq is not None:
            self._abort_ids.add(request_id)
            self._wake_driver()

    def pause(self) -> None:
        """Stop admitting and decoding; requests stay queued or running (aborts still apply)."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake_driver()

    def update_weights(
        self, weights: Mapping[str, Tensor], version: int, mode: WeightUpdateMode = "interrupt"
    ) -> None:
        """Copy ``weights`` (``state_dict`` names covering every parameter; tied aliases count once)
        into the model now, between steps, and tag later tokens with ``version``."""
        if mode not in _MODES:
            raise ValueError(f"unknown weight update mode {mode!r}; expected one of {_MODES}")
        state = self.model.state_dict()
        unknown = sorted(set(weights) - set(state))
        bad = [n for n, w in weights.items() if n in state and w.shape != state[n].shape]
        covered = {state[n].data_ptr() for n in weights if n in state}
        missing = [n for n, p in self.model.named_parameters() if p.data_ptr() not in covered]
        problems = [("unknown names", unknown), ("missing parameters", missing), ("shape mismatch", bad)]
        if any(names for _, names in problems):
            detail = "; ".join(f"{what} {names[:5]} ({len(names)})" for what, names in problems if names)
            raise ValueError(f"update_weights: {detail}")
        with torch.no_grad():
            for name, tensor in weights.items():
                state[name].copy_(tensor)
        logger.debug("weights v%d -> v%d (mode=%s)", self.version, version, mode)
        self.version = version

    def stats(self) -> dict[str, float]:
        running = len(self._rows.seqs) if self._rows is not None else 0
        counts = {"running": running, "waiting": len(self._waiting), **self._counts, "version": self.version}
        return {name: float(value) for name, value in counts.items()}

    def submit(self, request: GenerationRequest) -> Future[Completion]:
        """Queue ``request`` without asyncio; the future resolves during some later ``step()``."""
        params = request.params
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if params.max_new_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError(f"request {request.request_id!r}: invalid sampling params {params}")
        seq = _Seq(request, Future())
        seq.future.add_done_callback(lambda f: self.abort(request.request_id) if f.cancelled() else None)
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        return seq.future

    def has_work(self) -> bool:
        return bool(self._waiting) or self._rows is not None

    def step(self) -> None:
        """One scheduler iteration: drop aborted rows, admit + prefill, one decode step."""
        with torch.inference_mode():
            if self._abort_ids and self._rows is not None:
                aborted = [s.request.request_id in self._abort_ids for s in self._rows.seqs]
                self._rows = self._retire(self._rows, torch.tensor(aborted, device=self.device), None)
            if self._paused:
                return
            self._admit()
            self._decode()
        self._counts["steps"] += 1

    def _admit(self) -> None:
        free = self.max_batch - (len(self._rows.seqs) if self._rows is not None else 0)
        if free <= 0 or not self._waiting:
            return
        new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        fresh, logits = self._prefill(new)
        done, stopped = self._advance(fresh, logits)
        kept = self._retire(fresh, done, stopped)
        if kept is not None:
            self._rows = kept if self._rows is None else self._rows.extend(kept)

    def _prefill(self, new: list[_Seq]) -> tuple[_Rows, Tensor]:
        """Prefill each distinct prompt once; returns the new rows and their logits [rows, V]."""
        groups: dict[tuple[int, ...], list[_Seq]] = {}
        for seq in new:
            groups.setdefault(tuple(seq.request.prompt_ids), []).append(seq)
        rows: _Rows | None = None
        logits: list[Tensor] = []
        for length in sorted({len(p) for p in groups}):
            prompts = [p for p in groups if len(p) == length]
            ids = torch.tensor(prompts, dtype=torch.long, device=self.device)  # [prompts, length]
            positions = torch.arange(length, device=self.device).expand(len(prompts), length)
            cache = DynamicCache()
            out = self.model(
                input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1
            )
            self._counts["prefill_tokens"] += ids.numel()
            share = torch.tensor([i for i, p in enumerate(prompts) for _ in groups[p]], device=self.device)
            part = self._new_rows([s for p in prompts for s in groups[p]], cache, share, length)
            logits.append(out.logits[:, -1].index_select(0, share))
            rows = part if rows is None else rows.extend(part)
        assert rows is not None
        return rows, torch.cat(logits)

    def _new_rows(self, seqs: list[_Seq], cache: DynamicCache, share: Tensor, length: int) -> _Rows:
        """Rows for ``seqs`` whose prompt KV is ``cache`` row ``share[i]`` (prompt ``length`` tokens)."""
        for layer in cache.layers:
            for attr in ("keys", "values"):
                setattr(layer, attr, getattr(layer, attr).index_select(0, share))
        n, params = len(seqs), [s.request.params for s in seqs]
        stops = max(1, *(len(p.stop_token_ids) for p in params))
        width = max(p.max_new_tokens for p in params)

        def new(values: Any, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        return _Rows(
            seqs=list(seqs),
            cache=cache,
            mask=new([[1] * length] * n),
            last=new([0] * n),
            pos=new([length] * n),
            key=new([_seed_key(s.request.seed) for s in seqs]),
            ngen=new([0] * n),
            max_new=new([p.max_new_tokens for p in params]),
            temp=new([p.temperature for p in params], torch.float32),
            top_p=new([p.top_p for p in params], torch.float64),
            stop=new([[*p.stop_token_ids, *[-1] * (stops - len(p.stop_token_ids))] for p in params]),
            out_tok=new([[0] * width] * n),
            out_lp=new([[0.0] * width] * n, torch.float32),
            out_ver=new([[0] * width] * n),
        )

    def _decode(self) -> None:
        rows = self._rows
        if rows is None:
            return
        rows.mask = F.pad(rows.mask, (0, 1), value=1)  # [rows, cols + 1]: the column `last` fills
        out = self.model(
            input_ids=rows.last.unsqueeze(1),
            attention_mask=rows.mask,
            position_ids=rows.pos.unsqueeze(1),
            past_key_values=rows.cache,
            use_cache=True,
        )
        rows.pos += 1
        done, stopped = self._advance(rows, out.logits[:, -1])
        self._rows = self._retire(rows, done, stopped)

    def _advance(self, rows: _Rows, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Sample the next token of every row from logits [rows, V]; returns (done, stopped) [rows]."""
        tokens, logprobs = sample_tokens(logits, rows.temp, rows.top_p, _uniforms(rows.key, rows.ngen))
        at = (torch.arange(len(rows.seqs), device=self.device), rows.ngen)
        rows.out_tok[at] = tokens
        rows.out_lp[at] = logprobs
        rows.out_ver[at] = self.version
        rows.ngen += 1
        rows.last = tokens
        self._counts["generated_tokens"] += len(rows.seqs)
        stopped = (rows.stop == tokens.unsqueeze(1)).any(1)
        return stopped | (rows.ngen >= rows.max_new), stopped

    def _retire(self, rows: _Rows, done: Tensor, stopped: Tensor | None) -> _Rows | None:
        """Resolve rows where ``done`` (reason from ``stopped``; None = aborted); return the rest."""
        if not bool(done.any()):
            return rows
        idx = done.nonzero().squeeze(1)
        tokens, logprobs = rows.out_tok[idx].tolist(), rows.out_lp[idx].tolist()
        versions, lengths = rows.out_ver[idx].tolist(), rows.ngen[idx].tolist()
        flags = stopped[idx].tolist() if stopped is not None else [None] * len(lengths)
        for j, (i, n, flag) in enumerate(zip(idx.tolist(), lengths, flags, strict=True)):
            reason: FinishReason = "abort" if flag is None else "stop" if flag else "length"
            self._resolve(rows.seqs[i], tokens[j][:n], logprobs[j][:n], versions[j][:n], reason)
        keep = (~done).nonzero().squeeze(1)
        return rows.select(keep) if keep.numel() else None

    def _resolve(self, seq: _Seq, tokens: list, logprobs: list, versions: list, reason: FinishReason) -> None:
        rid = seq.request.request_id
        self._by_id.pop(rid, None)
        self._abort_ids.discard(rid)
        if not seq.future.done():
            args = (tuple(tokens), tuple(logprobs), tuple(versions), reason)
            seq.future.set_result(Completion(rid, seq.request.prompt_ids, *args))

    def _ensure_driver(self) -> None:
        loop = asyncio.get_running_loop()
        if self._driver is None or self._driver.done() or self._driver.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._driver = loop.create_task(self._drive(self._wake))
        self._wake_driver()

    def _wake_driver(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _drive(self, wake: asyncio.Event) -> None:
        """Run steps while there is work, yielding to the loop between steps; exit when idle."""
        try:
            while self.has_work():
                if self._paused and not self._abort_ids:
                    wake.clear()
                    await wake.wait()
                    continue
                self.step()
                await asyncio.sleep(0)
        except Exception as exc:  # a failed step fails every pending request instead of hanging it
            logger.exception("inference step failed; failing %d pending requests", len(self._by_id))
            seqs, self._by_id, self._rows = list(self._by_id.values()), {}, None
            self._waiting.clear()
            self._abort_ids.clear()
            for seq in (s for s in seqs if not s.future.done()):
                seq.future.set_exception(exc)

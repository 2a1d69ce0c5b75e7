"""The built-in inference engine: continuous batching over a Hugging Face causal LM in torch.

``HFInferenceEngine`` implements ``InferenceEngine`` for full-attention ``AutoModelForCausalLM``
models (Llama, Qwen2, ...); the default RL loop generates with it on CPU. Each ``step()`` is
deterministic (no clock): drop rows aborted since the last step; admit waiting requests (FIFO) up
to ``max_batch``, prefilling each distinct prompt once (a multi-turn session's next prompt: only
its new tokens, over the cache its previous turn left, ``session_cache.py``) and sampling their
first token from the prefill logits; then one decode step for all running rows. The running
batch shares one right-aligned, preallocated KV cache (``kv_batch.py``); sampling is
counter-based per sample (``sampling.py``): a sample's tokens do not depend on its neighbours.

Weight updates, always applied between two steps (docs/engines.md "Weight updates"):
``interrupt`` (AReaL) loads now and re-prefills every running row under the new weights (with
``reprefill=False``, PipelineRL, the rows keep their stale KV cache and decode on); emitted tokens
keep their versions. ``defer`` (AsyncFlow) stages the weights in a host buffer, stops admitting,
drains the running rows on the old weights, then swaps (drain time counted in ``stats()``; a
newer update replaces a staged one). ``staggered`` acts like ``defer`` (the LLMProxy staggers).

Not thread-safe: call ``update_weights`` from the thread that runs ``step()`` (the event loop
in the async driver). Deliberately not here: paged KV, chunked prefill, speculative decoding.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from sluice.api.protocols import WeightUpdateMode
from sluice.api.types import Completion, FinishReason, GenerationRequest
from sluice.engines.arrival_hold import ArrivalHold
from sluice.engines.hf_model import check_state_names, load_causal_lm, stage_weights
from sluice.engines.kv_batch import Rows, Slab, prefill, prefill_plan
from sluice.engines.lean_forward import causal_lm_logits
from sluice.engines.sampling import sample_tokens, seed_key, uniforms
from sluice.engines.session_cache import SessionCache, continue_prefill

__all__ = ["HFInferenceEngine", "sample_tokens"]

logger = logging.getLogger(__name__)

_MODES = ("interrupt", "defer", "staggered")


@dataclass(eq=False)  # compared by identity
class _Seq:
    request: GenerationRequest
    future: Future[Completion]
    order: int  # submission number: rows finishing in one step resolve in this order
    version: int = -1  # the weights version its KV cache was computed with


@dataclass
class _Staged:
    """Weights waiting in host memory for the running rows to drain."""

    weights: dict[str, Tensor]
    version: int
    since: float  # perf_counter() when admission stopped (the first of superseded stagings)


class HFInferenceEngine:
    """Continuous-batching generation with a Hugging Face causal LM (see the module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch: int = 256,
        version: int = 0,
        device: str | None = None,
        admit_fraction: float = 0.25,
        reprefill: bool = True,
        session_cache_mib: int = 0,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if device is not None:
            torch.nn.Module.to(model, device)  # in place (transformers' typed `.to` confuses mypy)
        self.model = model.eval()
        self.device = next(self.model.parameters()).device
        self.max_batch = max_batch
        self._admit_batch = max(1, int(max_batch * admit_fraction))
        self.reprefill = reprefill
        """``interrupt``: rebuild running rows' KV cache under the new weights (else keep the stale one)."""
        self.version = version
        self._waiting: deque[_Seq] = deque()
        self._submitted = 0
        self._rows: Rows | None = None
        self._spare: Slab | None = None  # the KV slab of rows no longer running: the next wave's
        self._by_id: dict[str, _Seq] = {}
        self._abort_ids: set[str] = set()
        self._paused = False
        self._driver: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._staged: _Staged | None = None
        self._host: dict[str, Tensor] = {}  # reusable staging buffers (pinned on CUDA)
        self._drain_s = self._drive_s = 0.0
        self._hold: ArrivalHold | None = None
        self._sessions = SessionCache(session_cache_mib << 20) if session_cache_mib > 0 else None  # turns' KV
        self._activated_at = time.time()
        counters = ("generated_tokens", "prefill_tokens", "prefills", "reprefill_tokens", "steps", "weight_updates")
        self._counts = dict.fromkeys((*counters, "stale_cache_rows", "weight_updates_superseded"), 0)

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> HFInferenceEngine:
        """Load a local HF model folder in float32 (eval mode); ``kwargs`` go to the constructor."""
        return cls(load_causal_lm(path, dtype=torch.float32), **kwargs)

    async def generate(self, request: GenerationRequest) -> Completion:
        """Queue ``request`` and await its completion (cancelling the await aborts it)."""
        future, _ = self.submit(request), self._ensure_driver()
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

    def update_weights(self, weights: Mapping[str, Tensor], version: int, mode: WeightUpdateMode = "interrupt") -> None:
        """Apply ``weights`` (``state_dict`` names covering every parameter; tied aliases count once)
        as ``version`` in ``mode`` (see the module docstring). ``interrupt`` loads before returning;
        ``defer`` / ``staggered`` copy to host memory and swap once the running rows drain (at once
        when none run). A newer update replaces a staged one."""
        if mode not in _MODES:
            raise ValueError(f"unknown weight update mode {mode!r}; expected one of {_MODES}")
        check_state_names(self.model, weights)
        staged, self._staged = self._staged, None
        if staged is not None:
            self._counts["weight_updates_superseded"] += 1
        if mode == "interrupt":
            if staged is not None:  # admission was stopped since it was staged
                self._drain_s += time.perf_counter() - staged.since
            self._load(weights, version, keep_sessions=not self.reprefill)
            if self._rows is not None and self.reprefill:
                with torch.inference_mode():
                    self._reprefill(self._rows)
            elif self._rows is not None:  # decoding goes on over the cache the older weights computed
                self._counts["stale_cache_rows"] += len(self._rows.seqs)
            return
        since = staged.since if staged is not None else time.perf_counter()
        self._staged = _Staged(stage_weights(self._host, weights, self.device), version, since)
        self._swap_if_drained()

    def expect_requests(self, expected: Callable[[], float], hold: float) -> None:
        """Wait before a step, up to ``hold`` step times, while ``expected()`` requests on their
        way outnumber the batch (``arrival_hold.py``; counted as ``holds`` / ``hold_s``)."""
        self._hold = ArrivalHold(expected, hold) if hold > 0 else None

    def stats(self) -> dict[str, float]:
        """Counters plus weight-sync state: ``version``, ``pending_version`` (-1: none staged),
        ``stale_cache_rows`` (rows an ``interrupt`` load left decoding over an older cache: ``reprefill=False``),
        ``weight_updates`` (loads), ``weight_updates_superseded`` (staged ones replaced by newer),
        ``weight_drain_s`` (cumulative seconds admission stood still for a staged update), ``session_*``
        (``session_cache.py``), ``drive_s`` (wall seconds of driven iterations: a step plus whatever
        else the event loop's thread ran before the next one, so ``drive_s / steps`` is the engine's
        effective iteration time; waits for expected requests not included), ``holds`` /
        ``hold_s`` (steps that waited for them, seconds waited) and ``version_activated_at``
        (``time.time()`` when the current version became active)."""
        running, pending = len(self._rows.seqs) if self._rows else 0, self._staged.version if self._staged else -1
        counts = {"running": running, "waiting": len(self._waiting), **self._counts, "version": self.version}
        extra = {
            **(self._sessions.counts if self._sessions is not None else {}),
            "pending_version": pending,
            "weight_drain_s": self._drain_s,
            "drive_s": self._drive_s,
            "holds": self._hold.holds if self._hold is not None else 0,
            "hold_s": self._hold.held_s if self._hold is not None else 0.0,
            "version_activated_at": self._activated_at,
        }
        return {name: float(value) for name, value in {**counts, **extra}.items()}

    def weights_checksum(self) -> float:
        """The float64 sum of every parameter element (tied aliases once): a cheap fingerprint."""
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model.parameters()))

    def submit(self, request: GenerationRequest) -> Future[Completion]:
        """Queue ``request`` without asyncio; the future resolves during some later ``step()``."""
        params = request.params
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if params.max_new_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError(f"request {request.request_id!r}: invalid sampling params {params}")
        seq = _Seq(request, Future(), self._submitted)
        self._submitted += 1
        seq.future.add_done_callback(lambda f: self.abort(request.request_id) if f.cancelled() else None)
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        return seq.future

    def _batch(self) -> int:
        return len(self._waiting) + (len(self._rows.seqs) if self._rows is not None else 0)

    def has_work(self) -> bool:
        return bool(self._waiting) or self._rows is not None or self._staged is not None

    def step(self) -> None:
        """One scheduler iteration: drop aborted rows, admit + prefill (unless an update is staged),
        one decode step; a staged update swaps in as soon as no row runs."""
        with torch.inference_mode():
            if self._abort_ids and self._rows is not None:
                aborted = [s.request.request_id in self._abort_ids for s in self._rows.seqs]
                self._rows = self._retire(self._rows, torch.tensor(aborted, device=self.device), None)
            self._swap_if_drained()
            if self._paused:
                return
            if self._staged is None:
                self._admit()
            self._decode()
            self._swap_if_drained()
        self._counts["steps"] += 1

    def _load(self, weights: Mapping[str, Tensor], version: int, keep_sessions: bool = False) -> None:
        """Load ``version``; kept turns stay only if running rows keep their older cache too."""
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in weights.items():
                state[name].copy_(tensor)
        logger.debug("weights v%d -> v%d", self.version, version)
        if self._sessions is not None and not keep_sessions:  # else: an interrupt without re-prefill
            self._sessions.clear()
        self.version = version
        self._counts["weight_updates"] += 1
        self._activated_at = time.time()

    def _swap_if_drained(self) -> None:
        if self._staged is None or self._rows is not None:
            return
        staged, self._staged = self._staged, None
        self._drain_s += time.perf_counter() - staged.since
        self._load(staged.weights, staged.version)

    def _reprefill(self, rows: Rows) -> None:
        """Rebuild the running rows' KV cache (prompt + tokens so far, not ``last``) with the current
        weights; ``last``, positions and sampling counters stay as they are."""
        sequences = rows.cached_tokens([s.request.prompt_ids for s in rows.seqs])
        cache, mask, _, computed = prefill(self.model, sequences)
        rows.replace_cache(cache, mask)
        for seq in rows.seqs:
            seq.version = self.version
        self._counts["reprefill_tokens"] += computed

    def _admit(self) -> None:
        """Admit waiting requests into free slots, in batches: each admission costs prefill forwards
        (``kv_batch.prefill_plan``) and a write into the slab, so admission waits until a quarter of
        the slots (or every waiting request) fits, unless nothing is running. Step-driven, so still
        deterministic."""
        running = len(self._rows.seqs) if self._rows is not None else 0
        free = self.max_batch - running
        if free <= 0 or not self._waiting:
            return
        if running and free < min(len(self._waiting), self._admit_batch):
            return
        new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        for seq in new:
            seq.version = self.version  # the weights its cache is computed with
        for seqs, (cache, mask, logits, computed) in self._prefills(new):
            self._counts["prefill_tokens"] += computed
            keys = [seed_key(s.request.seed) for s in seqs]
            spare, self._spare = self._spare, None
            fresh = Rows.start(seqs, [s.request.params for s in seqs], keys, cache, mask, spare)
            done, stopped = self._advance(fresh, logits)
            kept = self._retire(fresh, done, stopped)
            if kept is not None and self._rows is not None:
                self._rows = self._rows.extend(kept)
                self._spare = kept.slab  # copied into the running rows' slab
            elif kept is not None:
                self._rows = kept

    def _prefills(self, new: list[_Seq]) -> list[tuple[list[_Seq], tuple[Any, Tensor, Tensor, int]]]:
        """Prefill forwards for ``new``: prompts extending their session's kept turn compute only
        their new tokens (one forward for all); the rest share left-padded forwards
        (``kv_batch.prefill_plan``: one for a wave of short prompts, whatever their lengths)."""
        turns = [self._sessions.take(s.request.session, s.request.prompt_ids) if self._sessions else None for s in new]
        hits = [(s, t) for s, t in zip(new, turns, strict=True) if t]
        fresh = [s for s, t in zip(new, turns, strict=True) if not t]
        prompts = [s.request.prompt_ids for s in fresh]
        plan = prefill_plan(prompts)
        self._counts["prefills"] += len(plan) + bool(hits)  # forwards
        parts = [(fresh, prefill(self.model, prompts, plan))] if fresh else []
        if hits:
            prompts = [s.request.prompt_ids for s, _ in hits]
            parts.append(([s for s, _ in hits], continue_prefill(self.model, [t for _, t in hits], prompts)))
        return parts

    def _decode(self) -> None:
        rows = self._rows
        if rows is None:
            return
        logits = causal_lm_logits(
            self.model,
            rows.last.unsqueeze(1),
            rows.open_column(),  # [rows, cols + 1]: the column `last` fills
            rows.pos.unsqueeze(1),
            rows.cache,
            last_only=False,
        )
        rows.close_column()
        rows.pos += 1
        done, stopped = self._advance(rows, logits[:, -1])
        self._rows = self._retire(rows, done, stopped)

    def _advance(self, rows: Rows, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Sample the next token of every row from logits [rows, V]; returns (done, stopped) [rows]."""
        tokens, logprobs = sample_tokens(logits, rows.temp, rows.top_p, uniforms(rows.key, rows.ngen))
        at = (torch.arange(len(rows.seqs), device=self.device), rows.ngen)
        rows.out_tok[at] = tokens
        rows.out_lp[at] = logprobs
        rows.out_ver[at] = self.version
        rows.ngen += 1
        rows.last = tokens
        self._counts["generated_tokens"] += len(rows.seqs)
        stopped = (rows.stop == tokens.unsqueeze(1)).any(1)
        return stopped | (rows.ngen >= rows.max_new), stopped

    def _retire(self, rows: Rows, done: Tensor, stopped: Tensor | None) -> Rows | None:
        """Resolve rows where ``done`` (reason from ``stopped``; None = aborted) in submission order
        (rows move slots when others leave, so row order is not admission order); return the rest."""
        if not bool(done.any()):
            return rows
        idx = done.nonzero().squeeze(1)
        tokens, logprobs = rows.out_tok[idx].tolist(), rows.out_lp[idx].tolist()
        versions, lengths = rows.out_ver[idx].tolist(), rows.ngen[idx].tolist()
        flags = stopped[idx].tolist() if stopped is not None else [None] * len(lengths)
        if self._sessions is not None and stopped is not None:  # their sessions' next turns may reuse the cache
            ends = zip(idx.tolist(), tokens, lengths, strict=True)
            self._sessions.keep_rows(rows, ends, self.version if self.reprefill else None)
        finished = list(zip(idx.tolist(), tokens, logprobs, versions, lengths, flags, strict=True))
        for i, tok, lp, ver, n, flag in sorted(finished, key=lambda f: rows.seqs[f[0]].order):
            reason: FinishReason = "abort" if flag is None else "stop" if flag else "length"
            self._resolve(rows.seqs[i], tok[:n], lp[:n], ver[:n], reason)
        keep = (~done).nonzero().squeeze(1).tolist()
        if not keep:
            self._spare = rows.slab  # nobody reads it any more: the next admission's
            return None
        return rows.select(keep)

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
                if self._hold is not None:
                    await self._hold.wait(self._batch, wake)
                start = time.perf_counter()
                self.step()
                await asyncio.sleep(0)
                took = time.perf_counter() - start
                self._drive_s += took
                if self._hold is not None:
                    self._hold.stepped(took)
        except Exception as exc:  # a failed step fails every pending request instead of hanging it
            logger.exception("inference step failed; failing %d pending requests", len(self._by_id))
            seqs, self._by_id, self._rows = list(self._by_id.values()), {}, None
            self._waiting.clear()
            self._abort_ids.clear()
            for seq in (s for s in seqs if not s.future.done()):
                seq.future.set_exception(exc)

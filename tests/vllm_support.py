"""What the vLLM tests share (``make vllm-test``, in ``.venv-vllm``): an event loop per module, the
tiny model vLLM's CPU kernels accept, a temp folder of the module's own, the files a weight
update could leave behind, requests, and the trainer's recomputed log-probs. Import only where
vLLM is installed (``psutil`` comes with it)."""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from sluice.api import Completion, GenerationRequest, Sample, SamplingParams
from sluice.engines.hf_model import load_tokenizer
from sluice.engines.hf_train import HFTrainEngine
from tiny import save_tiny_task_model


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    pending = asyncio.all_tasks(loop)  # vLLM's output handler outlives the engine's shutdown
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_task_model(tmp_path_factory.mktemp("vllm_model"), head_dim=64)


@pytest.fixture(scope="module")
def temp_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A temp folder of this module's own, for this process and vLLM's (set before they spawn)."""
    root = tmp_path_factory.mktemp("vllm_tmpdir")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"], tempfile.tempdir = str(root), None
    yield root
    if old is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None


def files(temp_root: Path) -> set[Path]:
    """Every file under the temp folder and this process tree's under /dev/shm (where a folder
    update would go; ``shm_files``)."""
    assert Path(tempfile.gettempdir()) == temp_root
    ours = this_tree()
    found = {p for p in temp_root.rglob("*") if p.is_file()}
    return {p for p in found if not named_after_other(p, [temp_root], ours)} | shm_files()


def shm_files() -> set[Path]:
    """The files under /dev/shm but those of a process outside this one's tree: named after one
    (``sluice-arena-<pid>-0`` of a test running beside this one on a shared machine), or a Python
    ``SharedMemory`` segment (``psm_<hex>``, no pid in its name: vLLM makes them while an engine
    starts, one beside this one too) that no process of this tree maps."""
    root, ours = Path("/dev/shm"), this_tree()
    found = {p for p in root.rglob("*") if p.is_file() and not named_after_other(p, [root], ours)}
    segments = {p for p in found if p.parent == root and p.name.startswith("psm_")}
    return found - segments | (segments & mapped_by(ours))


def this_tree() -> set[int]:
    return {os.getpid()} | {child.pid for child in psutil.Process().children(recursive=True)}


def named_after_other(path: Path, roots: list[Path], ours: set[int]) -> bool:
    top = next(path.relative_to(root).parts[0] for root in roots if path.is_relative_to(root))
    pids = {int(n) for n in re.findall(r"-(\d+)(?=-|$)", top)}
    return bool(pids) and not pids & ours


def mapped_by(pids: set[int]) -> set[Path]:
    """The /dev/shm files any of ``pids`` maps (a process gone meanwhile maps nothing)."""
    mapped: set[Path] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        mapped |= {Path(m) for m in re.findall(r"(/dev/shm/\S+)", maps)}
    return mapped


def ids(model_dir: Path, text: str) -> tuple[int, ...]:
    return tuple(load_tokenizer(model_dir)(text)["input_ids"])


def request(rid: str, prompt: tuple[int, ...], n: int, seed: int = 0, **params: Any) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_new_tokens=n, **params), seed=seed)


def generate_all(loop: asyncio.AbstractEventLoop, engine: Any, requests: list[GenerationRequest]) -> list:
    async def main() -> list[Completion]:
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    return loop.run_until_complete(main())


def recomputed(model: Any, completions: list[Completion], temperature: float) -> list[list[float]]:
    """What the trainer computes for these completions (its own log-prob code)."""
    samples = [
        Sample(c.request_id, 0, c.prompt_ids, c.token_ids, c.logprobs, c.versions, (1,) * len(c.token_ids), 0.0)
        for c in completions
    ]
    return HFTrainEngine(model, lr=1e-3).logprobs(samples, temperature)

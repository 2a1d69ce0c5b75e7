import os
import sys
from pathlib import Path

# One torch thread per process, fixed before torch starts its thread pools: the same numeric
# environment as a Ray actor (Ray sets OMP_NUM_THREADS=1 for one-CPU actors), which the
# bit-for-bit sync-vs-async tests rely on; and tests never oversubscribe the 2 cores.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).parent.parent / "benchmarks"))  # benchmark helpers: harness/
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for the whole pytest session (started on first use)."""
    import ray

    # Ray workers inherit the environment of the processes ray.init starts, so they can import
    # the test helpers (fakes.py) that tests pass into actors.
    here = str(Path(__file__).parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=256 * 1024**2,
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_task_model(tmp_path_factory):
    """One saved random tiny model with the default task's tokenizer, shared by end-to-end tests."""
    from tiny import save_tiny_task_model

    return save_tiny_task_model(tmp_path_factory.mktemp("tiny_task_model"))


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests skip, saying why, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

import json
import os
import sys
from pathlib import Path

# One torch thread per process, fixed before torch starts its thread pools: the same numeric
# environment as a Ray actor (Ray sets OMP_NUM_THREADS=1 for one-CPU actors), which the
# bit-for-bit sync-vs-async tests rely on; and tests never oversubscribe the 2 cores.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM on CPU ("auto") binds its one compute thread to core 0 in every process that starts an
# engine: two pytest-xdist workers' engines (`make vllm-test`) would share that core while the
# other waits. Each worker's engines get a core of their own instead (inherited by the engine
# processes and by this worker's Ray actors).
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    worker = int(os.environ["PYTEST_XDIST_WORKER"][2:])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(worker % (os.cpu_count() or 1)))

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).parent.parent / "benchmarks"))  # benchmark helpers: harness/
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Each test starts on one torch thread, whatever the test before it set (an in-process
    ``RLTrainer`` sets ``run.threads``): batched kernels on two threads round differently, and a
    test's bit-for-bit comparisons must not depend on which test ran before it in its worker."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield


def _start_ray():
    import ray

    # Ray workers inherit the environment of the processes ray.init starts, so they can import
    # the test helpers (fakes.py) that tests pass into actors.
    here = str(Path(__file__).parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *paths])
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=256 * 1024**2,
        log_to_driver=False,
    )


@pytest.fixture(scope="session")
def _ray_session():
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_cluster(_ray_session):
    """One local Ray instance shared by the session's tests, started on first use, and again if a
    run that started its own Ray (a ``run.backend=ray`` test without this fixture) shut it down."""
    import ray

    if not ray.is_initialized():
        _start_ray()
    return ray


@pytest.fixture(scope="session")
def tiny_task_model(tmp_path_factory):
    """One saved random tiny model with the default task's tokenizer, shared by end-to-end tests."""
    from tiny import save_tiny_task_model

    return save_tiny_task_model(tmp_path_factory.mktemp("tiny_task_model"))


@pytest.fixture(scope="session")
def shared_tmp_path(tmp_path_factory) -> Path:
    """A temporary folder every pytest-xdist worker of this session shares (the session's own
    folder without xdist): for results computed once per session and compared by several tests.
    Writers take a ``filelock.FileLock`` beside what they write."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent / "shared" if os.environ.get("PYTEST_XDIST_WORKER") else base / "shared"
    shared.mkdir(exist_ok=True)
    return shared


TEST_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "sluice-tests"
"""Built models every test session (and every pytest-xdist worker) shares: each is built once,
under a file lock, in a folder named by its recipe (``ensure_base_model`` hashes the recipe), then
read-only. ``make clean`` removes it."""


@pytest.fixture(scope="session")
def calculator_warm_start() -> Path:
    """A short SFT warm start of the calculator task (``examples/calculator_agent``'s base model
    recipe at 100 steps of 32 rows instead of 400 of 64: ≈ 5 s instead of ≈ 35 s to build, and it
    already calls the tool and answers some prompts, all the agent tests ask of it); built once
    and reused by later sessions while its recipe holds. Runs pass it as ``model.path``."""
    from dataclasses import replace

    from filelock import FileLock

    from sluice.tasks import TASKS
    from sluice.tasks.base_model import ensure_base_model

    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(TEST_CACHE / "calculator.lock")):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            task = TASKS["calculator"]
            return ensure_base_model(replace(task, sft=replace(task.sft, steps=100, batch_size=32)), TEST_CACHE, 0, 500)
        finally:
            torch.set_num_threads(threads)


DURATIONS = Path(__file__).with_name("durations.json")
"""Each test's seconds on this machine's kind, written by ``benchmarks/ci_time.py --durations``."""


@pytest.hookimpl(trylast=True)  # after `-m` deselected: a file counts what runs
def pytest_collection_modifyitems(config, items):
    """The longest test files first: pytest-xdist's ``worksteal`` hands each worker a contiguous
    share and steals from the end of a worker's queue, so an 80 s file that starts last keeps one
    worker busy while the other waits. A file's tests stay together and in their order (its
    module-scoped fixtures start once); unknown tests (new ones) count as 1 s. ``@pytest.mark.gpu``
    tests skip, saying why, where torch sees no CUDA device."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    by_file: dict[str, float] = {}
    for item in items:
        file = item.nodeid.split("::")[0]
        by_file[file] = by_file.get(file, 0.0) + seconds.get(item.nodeid, 1.0)
    items.sort(key=lambda item: -by_file[item.nodeid.split("::")[0]])  # stable: a file's order holds
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

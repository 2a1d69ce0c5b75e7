"""Placement of the pipeline's workers: every Ray actor must fit the cluster at once; the queue
tasks each worker serves; a failed column-task worker stops the run instead of hanging it."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from fakes import length_reward
from sluice.api import SamplingParams
from sluice.config import load_config
from sluice.queue import LocalQueue
from sluice.queue.samples import SAMPLE_COLUMNS
from sluice.runtime.pipelines import LocalPipeline, PipelineSpec, queue_tasks
from sluice.runtime.placement import (
    RayPlacement,
    Slot,
    actor_cpu_share,
    bundle_node,
    check_fits,
    gpu_share,
    node_address,
    plan_placement,
)
from sluice.runtime.ray_pipeline import RayPipeline
from sluice.trainer.ppo import VALUES_COLUMN
from sluice.trainer.worker import TRAIN_TASK


def _spec(*overrides: str) -> PipelineSpec:
    config = load_config(None, ["run.backend=ray", *overrides])
    params = SamplingParams(max_new_tokens=4)
    return PipelineSpec(config, Path("."), length_reward, params)


def _share(cpus: float, spec: PipelineSpec) -> float:
    """Each actor's CPUs as the pipeline plans them (the rollout's, which every trainer rank and
    node-task worker gets too)."""
    plan = plan_placement(spec.config.resources, {"CPU": cpus}, len(queue_tasks(spec)) - 1)
    assert all(slot.cpus == plan.rollout.cpus for slot in plan.trainers)
    return plan.rollout.cpus


def test_actors_share_cpus_so_trainer_ranks_and_reference_are_placed_together():
    # 2 CPUs: rollout + 2 trainer ranks must all start, or the ranks' rendezvous never completes
    assert _share(2.0, _spec("resources.trainer.ranks=2", "trainer.strategy=ddp")) * 3 <= 2.0
    assert _share(2.0, _spec()) == 1.0  # rollout + one trainer: a CPU each
    assert _share(16.0, _spec("resources.trainer.ranks=4", "trainer.strategy=ddp")) == 1.0
    # with a KL term the trainer waits on the reference worker's column
    assert _share(2.0, _spec("trainer.kl_coef=0.01")) * 3 <= 2.0
    assert actor_cpu_share(2.0, 3) * 3 <= 2.0


def test_the_critic_values_task_gets_a_worker_and_the_trainer_reads_its_column():
    critic = _spec("trainer.algorithm=ppo")
    assert _share(2.0, critic) * 3 <= 2.0  # rollout, trainer and the critic-values worker
    tasks = queue_tasks(critic)
    assert tasks["values"] == SAMPLE_COLUMNS and tasks[TRAIN_TASK] == (*SAMPLE_COLUMNS, VALUES_COLUMN)
    assert set(queue_tasks(_spec())) == {TRAIN_TASK}


def test_a_failed_column_task_stops_the_run_instead_of_leaving_the_trainer_waiting():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        failed, finished = loop.create_future(), loop.create_future()
        failed.set_exception(ValueError("critic worker broke"))
        finished.set_result(0)
        with pytest.raises(ValueError, match="critic worker broke"):
            await RayPipeline._unless_a_task_stopped(SimpleNamespace(_served=[failed]), loop.create_future())
        with pytest.raises(RuntimeError, match="stopped while the trainer waited"):
            await RayPipeline._unless_a_task_stopped(SimpleNamespace(_served=[finished]), loop.create_future())
        serving = SimpleNamespace(_served=[loop.create_future()])
        await RayPipeline._unless_a_task_stopped(serving, asyncio.sleep(0))  # the work ends first: fine

    asyncio.run(scenario())

    class Broken:
        def serve(self) -> int:
            raise ValueError("no critic")

    local = SimpleNamespace(_node_tasks=ThreadPoolExecutor(1), queue=LocalQueue(), _served=[])
    LocalPipeline._serve(local, Broken())  # type: ignore[arg-type]
    local._node_tasks.shutdown(wait=True)
    assert local.queue._closed and isinstance(local._served[0].exception(), ValueError)


def test_workers_get_a_gpu_each_only_when_the_cluster_has_one_for_each():
    assert gpu_share(0, 1, 2) == (0.0, 0.0)  # CPU cluster: every engine on CPU
    assert gpu_share(1, 1, 2) == (1.0, 0.0)  # the rollout takes the GPU, the ranks train on CPU
    assert gpu_share(8, 1, 7) == (1.0, 1.0)  # 1 rollout + 7 trainer ranks on one 8-GPU node
    assert gpu_share(8, 1, 8) == (1.0, 0.0)
    assert gpu_share(8, 4, 4) == (1.0, 1.0)  # 4 replicas + 4 ranks
    assert gpu_share(2, 4, 4) == (0.25, 0.0)  # the replicas share the rollout's one GPU


def _plan(*overrides: str, cluster: dict[str, float] | None = None):
    resources = _spec(*overrides).config.resources
    return plan_placement(resources, cluster or {"CPU": 16.0, "GPU": 8.0}, 0)


def test_colocated_packs_rollout_and_trainer_bundles_in_one_group():
    eight = ["resources.rollout.replicas=4", "resources.rollout.gpus=1", "resources.rollout.replica_actors=true"]
    ranks = ["resources.trainer.ranks=4", "resources.trainer.gpus=1", "trainer.strategy=fsdp2"]
    plan = _plan(*eight, *ranks, "resources.placement=colocated")
    assert [strategy for strategy, _ in plan.groups] == ["PACK"]
    bundles = plan.groups[0][1]
    assert bundles[0] == {"CPU": 1.0, "GPU": 4.0} and bundles[1:] == [{"CPU": 1.0, "GPU": 1.0}] * 4
    assert (plan.rollout.group, plan.rollout.bundle, plan.rollout.gpus) == (0, 0, 0.0)  # the replicas hold the GPUs
    assert plan.replica_gpus == 1.0
    assert [(s.group, s.bundle, s.gpus) for s in plan.trainers] == [(0, 1 + r, 1.0) for r in range(4)]


def test_disaggregated_gives_each_role_its_own_group_and_node_labels():
    labels = ["resources.rollout.node_resource=rollout_node", "resources.trainer.node_resource=train_node"]
    plan = _plan("resources.rollout.replicas=2", "resources.trainer.ranks=2", "trainer.strategy=ddp",
                 "resources.placement=disaggregated", *labels, "resources.rollout.cpus=2")  # fmt: skip
    assert [(strategy, len(bundles)) for strategy, bundles in plan.groups] == [("PACK", 1), ("PACK", 2)]
    assert plan.groups[0][1] == [{"CPU": 2.0, "GPU": 2.0, "rollout_node": 0.001}]  # in-process replicas
    assert plan.groups[1][1] == [{"CPU": 1.0, "GPU": 1.0, "train_node": 0.001}] * 2
    assert plan.rollout.labels == {"rollout_node": 0.001} and plan.rollout.gpus == 2.0 and plan.replica_gpus == 0.0
    assert [(s.group, s.bundle, s.labels) for s in plan.trainers] == [(1, r, {"train_node": 0.001}) for r in range(2)]
    cpu = _plan("resources.placement=disaggregated", cluster={"CPU": 4.0})
    assert cpu.groups == [("PACK", [{"CPU": 1.0}]), ("PACK", [{"CPU": 1.0}])]  # no zero GPUs (Ray refuses them)


NODES = [
    {"NodeID": "aa", "Alive": True, "NodeManagerAddress": "10.0.0.1", "NodeManagerHostname": "head"},
    {"NodeID": "bb", "Alive": False, "NodeManagerAddress": "10.0.0.9", "NodeManagerHostname": "gone"},
    {"NodeID": "bb", "Alive": True, "NodeManagerAddress": "10.0.0.2", "NodeManagerHostname": "trainer-host"},
]


def test_rendezvous_addresses_are_the_chosen_nodes_ip_never_a_hostname():
    table = {"bundles_to_node_id": {0: "aa", 1: "bb", 2: "bb"}}  # rollout on the head, ranks on bb
    assert node_address(bundle_node(table, 1), NODES) == "10.0.0.2"  # trainer rank 0's node, alive
    assert node_address(bundle_node(table, 0), NODES) == "10.0.0.1"
    with pytest.raises(RuntimeError, match="cc is not among"):
        node_address("cc", NODES)


def test_the_free_address_task_imports_no_torch(monkeypatch):
    """``free_address_on`` runs its function in a Ray task pinned to the node; the task's fresh
    worker imports the function's module (Ray pickles it by reference) before a broadcast run
    creates its rollout and trainer actors: a module importing torch there costs ≈ 3 CPU-s."""
    import subprocess
    import sys

    import ray

    sent = []

    def remote(**_options):
        def task(function):
            sent.append(function)
            return SimpleNamespace(options=lambda **_: SimpleNamespace(remote=function))

        return task

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "get", lambda value: value)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "ab" * 28, "Alive": True, "NodeManagerAddress": "127.0.0.1"}])
    placement = object.__new__(RayPlacement)
    monkeypatch.setattr(placement, "node_of", lambda slot: "ab" * 28, raising=False)
    assert placement.free_address_on(Slot(0, 0, 1.0, 0.0)).startswith("tcp://127.0.0.1:")
    heavy = "('torch', 'transformers')"
    probe = f"import sys, {sent[0].__module__}; print(sorted(m for m in {heavy} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_ray_workers_device_is_the_gpu_ray_gave_it():
    from sluice.engines.hf_model import device_for, ray_gpu_ids

    assert device_for(["0"], cuda_available=True).type == "cuda"
    assert device_for([], cuda_available=True).type == "cpu"  # Ray gave it none: not another worker's GPU
    assert device_for(None, cuda_available=True).type == "cuda"  # no Ray: what is visible
    assert device_for(None, cuda_available=False).type == "cpu"
    assert ray_gpu_ids() is None  # this test process is no Ray worker


def test_a_plan_the_cluster_can_never_hold_is_refused_naming_the_keys():
    cpu_only = {"CPU": 4.0}
    check_fits(_plan("resources.trainer.ranks=2", "trainer.strategy=ddp", cluster=cpu_only), cpu_only)
    with pytest.raises(RuntimeError, match=r"resources\.\*\.gpus: the workers need 1 GPU but the Ray cluster has 0"):
        check_fits(_plan("resources.rollout.gpus=1", cluster=cpu_only), cpu_only)
    labelled = _plan("resources.rollout.node_resource=rollout_node", cluster=cpu_only)
    with pytest.raises(RuntimeError, match=r"resources\.\*\.node_resource: .* 0\.001 rollout_node .* has 0"):
        check_fits(labelled, cpu_only)
    check_fits(labelled, {**cpu_only, "rollout_node": 1.0})

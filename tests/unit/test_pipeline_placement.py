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
from sluice.controller.pipelines import LocalPipeline, PipelineSpec, queue_tasks
from sluice.controller.ray_pipeline import RayPipeline, actor_cpu_share, gpu_share
from sluice.queue import LocalQueue
from sluice.queue.samples import SAMPLE_COLUMNS
from sluice.trainer.ppo import VALUES_COLUMN
from sluice.trainer.worker import TRAIN_TASK


def _spec(*overrides: str) -> PipelineSpec:
    config = load_config(None, ["run.backend=ray", *overrides])
    params = SamplingParams(max_new_tokens=4)
    return PipelineSpec(config, Path("."), length_reward, params)


def test_actors_share_cpus_so_trainer_ranks_and_reference_are_placed_together():
    # 2 CPUs: rollout + 2 trainer ranks must all start, or the ranks' rendezvous never completes
    assert actor_cpu_share(2.0, _spec("trainer.data_parallel=2", "trainer.strategy=ddp")) * 3 <= 2.0
    assert actor_cpu_share(2.0, _spec()) == 1.0  # rollout + one trainer: a CPU each
    assert actor_cpu_share(16.0, _spec("trainer.data_parallel=4", "trainer.strategy=ddp")) == 1.0
    # with a KL term the trainer waits on the reference worker's column
    assert actor_cpu_share(2.0, _spec("trainer.kl_coef=0.01")) * 3 <= 2.0


def test_the_critic_values_task_gets_a_worker_and_the_trainer_reads_its_column():
    critic = _spec("trainer.algorithm=ppo")
    assert actor_cpu_share(2.0, critic) * 3 <= 2.0  # rollout, trainer and the critic-values worker
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
    assert gpu_share(0, 2) == (0.0, 0.0)  # CPU cluster: every engine on CPU
    assert gpu_share(1, 2) == (1.0, 0.0)  # the rollout takes the GPU, the ranks train on CPU
    assert gpu_share(8, 7) == (1.0, 1.0)  # 1 rollout + 7 trainer ranks on one 8-GPU node
    assert gpu_share(8, 8) == (1.0, 0.0)

"""Placement of the Ray pipeline's actors: every actor must fit the cluster at once."""

from dataclasses import replace
from pathlib import Path

from fakes import FakeAlgorithm, length_reward
from sluice.api import SamplingParams
from sluice.controller.pipelines import PipelineSpec, actor_cpu_share


def _spec(**kw) -> PipelineSpec:
    base = PipelineSpec(
        model_dir=Path("."), reward=length_reward, params=SamplingParams(max_new_tokens=4), group_size=2,
        run_seed=0, max_batch=4, algorithm=FakeAlgorithm(), engine_kwargs={}, micro_batch_tokens=64,
        weight_update="interrupt",
    )  # fmt: skip
    return replace(base, **kw)


def test_actors_share_cpus_so_trainer_ranks_and_reference_are_placed_together():
    # 2 CPUs: rollout + 2 trainer ranks must all start, or the ranks' rendezvous never completes
    assert actor_cpu_share(2.0, _spec(data_parallel=2)) * 3 <= 2.0
    assert actor_cpu_share(2.0, _spec()) == 1.0  # rollout + one trainer: a CPU each
    assert actor_cpu_share(16.0, _spec(data_parallel=4)) == 1.0
    with_reference = FakeAlgorithm()
    with_reference.uses_reference = True  # the trainer waits on the reference worker's column
    assert actor_cpu_share(2.0, _spec(algorithm=with_reference)) * 3 <= 2.0

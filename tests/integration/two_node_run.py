"""A two-node local Ray cluster (``ray.cluster_utils.Cluster``) for ``test_resources.py``, run in a
process of its own (a pytest session holds one Ray instance): the head advertises
``trainer_node``, the second node ``rollout_node``. It trains 2 steps on the cluster through
``run.ray_address`` with ``resources`` naming those labels, and reports the node id each of the
run's own actors gives as it starts (one pipeline: placing a second one only to ask it cost half
the test); it prints one JSON line. Not a test itself.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: fakes, tiny

import ray
from ray.cluster_utils import Cluster

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from sluice.controller import training
from sluice.runtime.ray_pipeline import RayPipeline
from tiny import tiny_run_overrides

NODE = {"num_cpus": 2, "object_store_memory": 96 * 1024**2}


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))


PLACED: dict[str, object] = {}
"""Each actor's node id, as the actor itself reports it, from the run's pipeline."""


class ReportingPipeline(RayPipeline):
    """The run's ``RayPipeline`` (``place_single`` builds it by this name), which asks each of its
    actors for its node once they are all up."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        replicas = ray.get(self.rollout_actor.__ray_call__.remote(lambda worker: list(worker.engines)))
        PLACED.update(
            rollout=ray.get(self.rollout_actor.node_id.remote()),
            replicas=[_node_of(replica) for replica in replicas],
            trainers=ray.get([a.node_id.remote() for a in self.trainer_actors]),
        )


def main(model_dir: Path, out: Path) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "resources": {"trainer_node": 1}})
    labelled = cluster.add_node(**NODE, resources={"rollout_node": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        resources = [
            "resources.placement=disaggregated", "resources.rollout.node_resource=rollout_node",
            "resources.trainer.node_resource=trainer_node", "resources.rollout.replicas=2",
            "resources.rollout.replica_actors=true", "resources.trainer.ranks=2", "trainer.strategy=ddp",
        ]  # fmt: skip
        run = [*tiny_run_overrides(model_dir, out, "two-node"), "run.backend=ray", f"run.ray_address={cluster.address}"]
        run += ["run.steps=2", "run.eval_every=0", "rollout.max_new_tokens=8", *resources]
        training.RayPipeline = ReportingPipeline  # type: ignore[misc]
        result = RLTrainer(load_config(None, run), reward=length_reward).fit()
        report = {**PLACED, "head": cluster.head_node.node_id, "labelled": labelled.node_id}
        report["metrics"] = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        print(json.dumps(report))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

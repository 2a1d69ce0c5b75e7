"""The synchronous loop and the single-turn workflow, driven with fakes (no model)."""

import asyncio
from collections.abc import Sequence

from fakes import FakeAlgorithm, FakeInferenceEngine, FakeTrainEngine
from sluice.api import PromptItem, Sample, SamplingParams
from sluice.controller.sync_loop import run_sync
from sluice.rollout.single_turn import SingleTurnWorkflow, group_stats, sample_seed
from sluice.trainer.step import plan_step, run_step, step_normaliser


class _Tok:
    eos_token_id = 3

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i % 10) for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def _reward(response: str, *, answer: str, **_) -> float:
    return float(response.startswith(answer))


class _Pipeline:
    """The loop's view of a run, composed of fakes."""

    def __init__(self, workflow: SingleTurnWorkflow) -> None:
        self.version = 0
        self.engine = FakeInferenceEngine()
        self.trainer = FakeTrainEngine()
        self.workflow = workflow
        self.buffer: list[Sample] = []
        self.next_group = 0
        self.calls: list[str] = []
        self.items = [PromptItem(i, f"p{i}", (1, i), {"answer": str(i % 3)}) for i in range(5)]

    def admit(self, num_groups):
        self.calls.append("admit")
        out = [(self.items[(self.next_group + k) % 5], self.next_group + k) for k in range(num_groups)]
        self.next_group += num_groups
        return out

    def generate(self, groups):
        self.calls.append("generate")

        async def _all():
            return await asyncio.gather(*(self.workflow.run(it, g, self.engine, _reward) for it, g in groups))

        return [s for grp in asyncio.run(_all()) for s in grp]

    def send_experience_data(self, samples: Sequence[Sample]) -> None:
        self.calls.append("send")
        self.buffer.extend(samples)

    def recv_experience_data(self, num_groups):
        self.calls.append("recv")
        batch, self.buffer = self.buffer, []
        return batch

    def train(self, samples):
        self.calls.append("train")
        algorithm = FakeAlgorithm()
        metrics = run_step(self.trainer, plan_step(samples, algorithm, 16), algorithm, step_normaliser(samples))
        self.version += 1
        return metrics

    def sync_actor_model(self):
        self.calls.append("sync")
        self.engine.update_weights(self.trainer.export_weights(), self.version)


def _workflow(group_size=4):
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(3,))
    return SingleTurnWorkflow(_Tok(), params, group_size=group_size, run_seed=11)


def test_loop_order_versions_and_stop():
    pipe = _Pipeline(_workflow())
    seen = []
    run_sync(pipe, steps=3, prompts_per_step=2, after_step=lambda v, b, m: seen.append((v, len(b))) or True)
    assert seen == [(1, 8), (2, 8), (3, 8)]
    assert pipe.calls[:6] == ["admit", "generate", "send", "recv", "train", "sync"]
    assert pipe.engine.loaded == [1, 2, 3]
    pipe2 = _Pipeline(_workflow())
    run_sync(pipe2, steps=5, prompts_per_step=2, after_step=lambda v, b, m: v < 2)
    assert pipe2.version == 2


def test_workflow_seeds_groups_and_rewards():
    wf = _workflow(group_size=3)
    engine = FakeInferenceEngine()
    item = PromptItem(0, "p", (1, 2), {"answer": "1"})
    samples = asyncio.run(wf.run(item, 7, engine, _reward))
    assert [s.uid for s in samples] == ["7-0", "7-1", "7-2"]
    assert {s.group_id for s in samples} == {7}
    assert [r.seed for r in engine.requests] == [sample_seed(11, 7, k) for k in range(3)]
    assert len({r.seed for r in engine.requests}) == 3
    for s in samples:
        assert len(s.response_ids) == len(s.behav_logprobs) == len(s.token_versions) == len(s.loss_mask)
        text = _Tok().decode(s.response_ids)
        assert s.reward == float(text.startswith("1"))
    again = asyncio.run(wf.run(item, 7, FakeInferenceEngine(), _reward))
    assert again == samples
    stats = group_stats(samples)
    assert 0.0 <= stats["reward_mean"] <= 1.0


def test_plan_step_shares_the_step_normaliser():
    wf = _workflow(group_size=4)
    item = PromptItem(0, "p", (1, 2, 3), {"answer": "1"})
    samples = asyncio.run(wf.run(item, 0, FakeInferenceEngine(), _reward))
    plan = plan_step(samples, FakeAlgorithm(), micro_batch_tokens=8)
    assert len(plan) > 1
    assert {mb.normaliser for mb in plan} == {1.0}  # sums; run_step scales by the step's tokens
    assert step_normaliser(samples) == sum(len(s.response_ids) for s in samples)
    assert [s.uid for mb in plan for s in mb.samples] == [s.uid for s in samples]  # in order
    assert all(mb.num_tokens <= 8 or len(mb.samples) == 1 for mb in plan)

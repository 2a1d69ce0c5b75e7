"""The single-turn workflow and the step's micro-batch plan, driven with fakes (no model)."""

import asyncio

from fakes import FakeAlgorithm, FakeInferenceEngine
from sluice.api import PromptItem, SamplingParams
from sluice.rollout.single_turn import SingleTurnWorkflow, sample_seed
from sluice.trainer.step import plan_step, step_normaliser


class _Tok:
    eos_token_id = 3

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i % 10) for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def _reward(response: str, *, answer: str, **_) -> float:
    return float(response.startswith(answer))


def _workflow(group_size=4):
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(3,))
    return SingleTurnWorkflow(_Tok(), params, group_size=group_size, run_seed=11)


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

"""``reward.judge``: the parsers, a judge's scores equal its answer from a direct ``transformers``
greedy generate parsed by hand, and an answer the parser cannot read fails the group (counted,
never a silent 0)."""

import asyncio
import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from sluice.api import Sample
from sluice.config import ConfigError, load_config
from sluice.rewards.combine import ModelReward
from sluice.rewards.judge import JudgeScorer, JudgeSpec, parse_judgement
from sluice.rollout.filters import reward_failure


def test_parsers():
    assert parse_judgement(" score: 7.5 of 10", "number") == 7.5
    assert parse_judgement("-3", "number") == -3.0
    assert math.isnan(parse_judgement("none", "number"))
    assert parse_judgement("Yes. It is right", "verdict") == 1.0 and parse_judgement("fail", "verdict") == 0.0
    assert math.isnan(parse_judgement("maybe", "verdict")) and math.isnan(parse_judgement("", "verdict"))
    assert parse_judgement("b) because", "choice", {"A": 1.0, "B": 0.25}) == 0.25
    assert math.isnan(parse_judgement("C", "choice", {"A": 1.0}))


def test_judge_scores_are_its_parsed_greedy_answers(tiny_task_model):
    judge = JudgeScorer(JudgeSpec(str(tiny_task_model), template="{prompt}{response}", max_new_tokens=6))
    texts = [("12>", "21"), ("345>", "543"), ("9>", "-9"), ("8076>", "6708")]
    scores = asyncio.run(judge.score(texts))
    model = AutoModelForCausalLM.from_pretrained(tiny_task_model)
    for (prompt, response), score in zip(texts, scores, strict=True):
        ids = judge.tokenizer(f"{prompt}{response}", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=judge.tokenizer.eos_token_id)
        answer = judge.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        digits = re.search(r"-?\d+", answer)  # by hand: the first (signed) run of digits
        assert (score == float(digits.group())) if digits else math.isnan(score), (answer, score)
    assert sum(not math.isnan(s) for s in scores) >= 2  # numbers to compare, not only garbage
    assert judge.stats()["judge_calls"] == 4.0


def test_a_garbage_answer_fails_its_group_and_is_counted(tiny_task_model):
    """A digits-only model asked for a verdict never says yes or no: each group fails as
    ``reward_invalid:judge``, counted, never scored 0."""
    judge = JudgeScorer(JudgeSpec(str(tiny_task_model), parser="verdict", max_new_tokens=4))
    samples = [Sample(f"0-{k}", 0, (1,), (5, 6), (0.0, 0.0), (0, 0), (1, 1), 1.0) for k in range(3)]
    out = asyncio.run(ModelReward(judge).apply("12>", samples, lambda ids: "21"))
    assert reward_failure(out) == "reward_invalid:judge"
    assert all("rm_score" not in s.meta for s in out)
    assert judge.stats()["judge_garbage"] == 3.0


def test_judge_config_is_checked():
    with pytest.raises(ConfigError, match=r"reward\.model and reward\.judge exclude each other"):
        load_config(None, ["reward.model=a", "reward.judge=b"])
    with pytest.raises(ConfigError, match=r"needs reward\.judge_choices"):
        load_config(None, ["reward.judge=b", "reward.judge_parser=choice"])

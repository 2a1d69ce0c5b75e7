"""An LLM judge (``reward.judge``): a generative model reads each response and its answer is parsed
into a score.

``JudgeScorer`` has the reward model's face (``await score(texts)`` → one value per (prompt,
response), ``stats``, ``close``), so ``rewards/combine.py`` scores whole groups with it before their
filters, exactly as with ``reward.model``. It renders ``reward.judge_template`` (``{prompt}`` and
``{response}``), generates greedily with the built-in engine (``engines/hf_inference.py``: one
engine in the rollout worker's process, continuous batching across the groups being judged; its
weights never change), and parses the answer (``parse_judgement``): ``number`` (the first number
in it), ``verdict`` (yes / no, true / false, pass / fail, correct / incorrect → 1 / 0) or
``choice`` (its first word looked up in ``reward.judge_choices``). An answer the parser cannot
read is never a silent 0: its value is NaN, counted as ``judge_garbage``, and ``combine.py``
fails that sample's group as ``reward_invalid:judge``. Deliberately not here: vLLM judges and
judge replicas behind their own proxy (not built yet), combining (``combine.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sluice.api import GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

NAME = "judge"
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
VERDICTS = {"yes": 1.0, "no": 0.0, "true": 1.0, "false": 0.0, "pass": 1.0, "fail": 0.0, "correct": 1.0,
            "incorrect": 0.0}  # fmt: skip


def parse_judgement(answer: str, parser: str, choices: Mapping[str, float] | None = None) -> float:
    """The judge's ``answer`` as a score; NaN when the parser cannot read it."""
    text = answer.strip()
    if parser == "number":
        found = _NUMBER.search(text)
        return float(found.group()) if found else math.nan
    word = re.split(r"[\s.,:;!()]+", text.lower(), maxsplit=1)[0] if text else ""
    table = VERDICTS if parser == "verdict" else {k.lower(): v for k, v in (choices or {}).items()}
    return float(table[word]) if word in table else math.nan


@dataclass(frozen=True)
class JudgeSpec:
    path: str
    template: str = "{prompt}{response}"
    parser: str = "number"
    choices: tuple[tuple[str, float], ...] = ()
    max_new_tokens: int = 16
    max_batch: int = 64


class JudgeScorer:
    """The judge as the rollout worker awaits it: ``await score(texts)`` → one score (or NaN) each."""

    def __init__(self, spec: JudgeSpec) -> None:
        from sluice.engines.hf_inference import HFInferenceEngine
        from sluice.engines.hf_model import load_tokenizer
        from sluice.engines.model_folder import check_model_dir

        check_model_dir(spec.path, "reward.judge")
        self.spec = spec
        self.name = NAME
        self.tokenizer = load_tokenizer(spec.path)
        self.engine = HFInferenceEngine.from_pretrained(spec.path, max_batch=spec.max_batch)
        self.params = SamplingParams(spec.max_new_tokens, 0.0, 1.0, (self.tokenizer.eos_token_id,))
        self.counts: Counter[str] = Counter()
        self._n = 0

    def prompt_ids(self, prompt: str, response: str) -> tuple[int, ...]:
        text = self.spec.template.format(prompt=prompt, response=response)
        return tuple(self.tokenizer(text)["input_ids"])

    async def answers(self, texts: Sequence[tuple[str, str]]) -> list[str]:
        """The judge's greedy answers to ``texts`` (decoded, without special tokens)."""
        requests = []
        for prompt, response in texts:
            self._n += 1
            requests.append(GenerationRequest(f"judge-{self._n}", self.prompt_ids(prompt, response), self.params))
        done = await asyncio.gather(*(self.engine.generate(r) for r in requests))
        return [self.tokenizer.decode(list(c.token_ids), skip_special_tokens=True) for c in done]

    async def score(self, texts: Sequence[tuple[str, str]]) -> list[float]:
        values = [parse_judgement(a, self.spec.parser, dict(self.spec.choices)) for a in await self.answers(texts)]
        self.counts["judge_calls"] += len(values)
        garbage = sum(math.isnan(v) for v in values)
        if garbage and not self.counts["judge_garbage"]:
            log.warning("reward.judge: an answer the %s parser cannot read (judge_garbage)", self.spec.parser)
        self.counts["judge_garbage"] += garbage
        return values

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.counts.items()}

    def close(self) -> None:
        pass

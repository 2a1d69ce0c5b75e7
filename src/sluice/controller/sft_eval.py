"""``sluice sft``'s evaluation of the weights being trained: validation loss, and greedy accuracy.

The validation loss is the token-mean NLL of every validation row's loss tokens (``trainer/sft.py``'s
``nll_sums``), each rank of a data-parallel run summing its share and the ranks adding them up.
With a reward configured, the greedy accuracy (and ``mean@k`` / ``pass@k``) on the validation rows'
prompts is ``sluice train``'s evaluator (``rollout/evaluate.py``) on an inference engine that loads
the trained weights (one process). It does not train, log or decide when to evaluate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sluice.api import PromptItem, Sample
from sluice.config import SluiceConfig
from sluice.data import PromptBuilder
from sluice.engines.hf_train import HFTrainEngine
from sluice.preflight import has_reward
from sluice.trainer.data_parallel import DataParallelGroup
from sluice.trainer.sft import nll_sums


class SftEvaluation:
    """Validation loss, and greedy accuracy with a reward, of an engine's current weights."""

    def __init__(
        self,
        cfg: SluiceConfig,
        val: list[Sample],
        tokenizer: Any,
        model_dir: str | Path,
        group: DataParallelGroup | None,
    ) -> None:
        self.cfg, self.model_dir, self.tokenizer, self.group = cfg, model_dir, tokenizer, group
        rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
        self.samples, self.any_samples = val[rank::world], bool(val)
        self.items: list[PromptItem] = []
        if has_reward(cfg) and cfg.data.val_files:
            from sluice.rewards import resolve_reward

            self.reward = resolve_reward(cfg.reward, None)
            self.items = PromptBuilder(cfg.data, tokenizer).read(cfg.data.val_files).items
        self._engine: Any = None

    @property
    def enabled(self) -> bool:
        return (self.any_samples or bool(self.items)) and self.cfg.run.eval_every > 0

    def __call__(self, engine: HFTrainEngine, step: int) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.any_samples:
            total, count = nll_sums(engine, self.samples)
            if self.group is not None:
                sums = self.group.all_gather((total, count))
                total, count = sum(s[0] for s in sums), sum(s[1] for s in sums)
            out["val_loss"] = total / max(count, 1.0)
        if self.items:
            out.update(self._accuracy(engine, step))
        return out

    def _accuracy(self, engine: HFTrainEngine, step: int) -> dict[str, float]:
        from sluice.engines.hf_inference import HFInferenceEngine
        from sluice.engines.hf_model import load_causal_lm
        from sluice.rollout.evaluate import evaluate

        if self._engine is None:
            self._engine = HFInferenceEngine(load_causal_lm(self.model_dir), max_batch=self.cfg.rollout.max_batch)
        self._engine.update_weights(engine.export_weights(), step)
        max_new = self.cfg.rollout.max_new_tokens or 1
        return evaluate(self._engine, self.items, self.tokenizer, self.reward, max_new, self.cfg.eval).metrics()

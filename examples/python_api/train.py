"""sluice from Python: the default task with your own reward function (AsyncFlow's user-level API)."""

from sluice import RLTrainer
from sluice.config import load_config


def reward(response: str, *, answer: str, **_) -> float:  # any RewardFn: text + the row's fields
    return float(response.strip() == answer)


config = load_config("examples/reverse_digits/config.yaml", ["run.steps=20", "run.name=python_api"])
trainer = RLTrainer(config, reward=reward)
trainer.init_engines()  # base model -> inference + train engines (or Ray workers in async mode)
trainer.load_prompt_data()  # or load_prompt_data([{"prompt": "12>", "answer": "21"}, ...])
result = trainer.fit()  # admit -> generate -> score -> store -> train -> sync weights, per step
if result.base_accuracy is not None and result.final_accuracy is not None:  # None with run.eval_every=0
    print(f"accuracy {100 * result.base_accuracy:.1f} -> {100 * result.final_accuracy:.1f}")

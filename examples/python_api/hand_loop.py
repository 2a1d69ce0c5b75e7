"""sluice from Python, the loop by hand: AsyncFlow's verbs over the same workers ``fit()`` uses.

    .venv/bin/python examples/python_api/hand_loop.py

Each step sends one wave of prompt groups (generated, scored and stored in the TransferQueue),
lets the trainer take one step over them, and syncs the new weights to the engines: the ``sync``
schedule, written out. With ``run.mode=async rollout.max_staleness=0`` it trains exactly what
``fit()`` trains (tests/integration/test_python_api.py).
"""

from pathlib import Path

from sluice import RLTrainer
from sluice.config import load_config


def train_by_hand(trainer: RLTrainer, steps: int, final_model: Path) -> list[dict[str, float]]:
    """``steps`` steps of admit → generate → score → store → train → sync weights; each step's metrics."""
    trainer.init_engines()
    trainer.load_prompt_data()
    history = []
    try:
        for _ in range(steps):
            group_ids = trainer.send_experience_data()  # B prompt groups, generated, scored, stored
            history.append(trainer.recv_experience_data(group_ids))  # one training step: v -> v + 1
            trainer.sync_actor_model()  # the engines now hold v + 1
        trainer.save_model(final_model)
    finally:
        trainer.close()
    return history


if __name__ == "__main__":
    config = load_config("examples/reverse_digits/config.yaml", ["run.steps=20", "run.name=python_api_loop"])
    for step, metrics in enumerate(train_by_hand(RLTrainer(config), config.run.steps, Path("runs/python_api_loop")), 1):
        print(f"step {step}: loss {metrics['loss']:+.4f}  grad norm {metrics['grad_norm']:.3f}")

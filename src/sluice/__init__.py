"""sluice: asynchronous, streaming RL post-training for LLMs.

Importing ``sluice`` is cheap: heavy modules (torch, transformers) load only when
``sluice.RLTrainer`` is first touched.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["RLTrainer", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "RLTrainer":
        from sluice.rl_trainer import RLTrainer

        return RLTrainer
    raise AttributeError(f"module 'sluice' has no attribute {name!r}")

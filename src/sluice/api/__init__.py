"""Contracts of sluice: typing Protocols at the seams and frozen wire dataclasses.

Importable without torch or any engine library; it defines shapes of data and calls, never
behaviour. Tensors appear only as annotations (``"torch.Tensor"``) so this package stays light.
"""

from sluice.api.protocols import Algorithm, InferenceEngine, RewardFn, TrainEngine, WeightSync
from sluice.api.types import (
    Completion,
    GenerationRequest,
    LossInputs,
    LossOutputs,
    MicroBatch,
    PromptItem,
    Sample,
    SamplingParams,
)

__all__ = [
    "Algorithm",
    "Completion",
    "GenerationRequest",
    "InferenceEngine",
    "LossInputs",
    "LossOutputs",
    "MicroBatch",
    "PromptItem",
    "RewardFn",
    "Sample",
    "SamplingParams",
    "TrainEngine",
    "WeightSync",
]

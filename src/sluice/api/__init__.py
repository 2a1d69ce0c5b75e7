"""Contracts of sluice: typing Protocols at the seams and frozen wire dataclasses.

Importable without torch or any engine library; it defines shapes of data and calls, never
behaviour. Tensors appear only as annotations (``"torch.Tensor"``) so this package stays light.
"""

from sluice.api.env import Env, EnvStep, ToolEnv
from sluice.api.protocols import (
    AdmissionCredits,
    Algorithm,
    ExpectsRequests,
    InferenceEngine,
    LengthPredictor,
    Replica,
    ReplicaLost,
    RewardFailure,
    RewardFn,
    TrainEngine,
    VersionedEngine,
    WeightSync,
)
from sluice.api.queue import (
    AsyncQueueClient,
    Batch,
    Partition,
    Policy,
    QueueClient,
    RowMeta,
    Shard,
    StorageUnit,
)
from sluice.api.types import (
    Completion,
    Credit,
    GenerationRequest,
    GroupReport,
    LossInputs,
    LossOutputs,
    MicroBatch,
    PromptItem,
    Sample,
    SamplingParams,
)

__all__ = [
    "AdmissionCredits",
    "Algorithm",
    "AsyncQueueClient",
    "Batch",
    "Completion",
    "Credit",
    "Env",
    "EnvStep",
    "ExpectsRequests",
    "GenerationRequest",
    "GroupReport",
    "InferenceEngine",
    "LengthPredictor",
    "LossInputs",
    "LossOutputs",
    "MicroBatch",
    "Partition",
    "Policy",
    "PromptItem",
    "QueueClient",
    "Replica",
    "ReplicaLost",
    "RewardFailure",
    "RewardFn",
    "RowMeta",
    "Sample",
    "SamplingParams",
    "Shard",
    "StorageUnit",
    "ToolEnv",
    "TrainEngine",
    "VersionedEngine",
    "WeightSync",
]

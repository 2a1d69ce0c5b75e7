"""Hybrid cost model (AsyncFlow §4.3): analytic FLOPs / bytes of each pipeline phase for a model
shape on a device, scaled by efficiencies that a short real measurement fits (``benchmarks/harness/fit.py``).

- **decode**: one iteration reads the weights once (memory-bound while the batch is small) and
  does ``2·N`` FLOPs plus a read of its KV cache per sequence, so its time is
  ``max(decode_s, batch · per_seq_s)`` = ``decode_s · max(1, batch / knee)``: exactly
  ``SimEngine``'s replica model, which ``engine_config`` fills in;
- **prefill**: ``2·N`` FLOPs per prompt token, compute-bound;
- **training**: ``6·N`` FLOPs per token for forward + backward (plus ``2·N`` per extra forward
  such as proximal or reference log-probs), a fixed cost per micro-batch, and an optimizer step
  that streams the parameters, gradients and Adam state once;
- **weight sync**: the weights cross the link between training and generation devices once,
  then each replica loads them.

Device presets give peak dense BF16 FLOP/s, memory bandwidth, memory and an hourly price (list
prices of late 2025 clouds, rounded; override them for your contract) so heterogeneous pairs
(StreamRL: generation on H20, training on H800) are compared by throughput per dollar. The CPU
preset was measured on the project machine (``benchmarks/harness/fit.py: measure_host``).

It does not schedule anything (``sim.simulate`` runs the pipeline) or model tensor-parallel
communication beyond dividing by the devices of a replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.sim.engine import LengthModel, SimEngineConfig

GB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's size (what the FLOPs and bytes depend on)."""

    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_param: float = 2.0

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer for one token of context."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


MODELS: dict[str, ModelShape] = {
    "qwen2.5-7b": ModelShape(7.6e9, 28, 3584, 4, 128),
    "qwen2.5-32b": ModelShape(32.8e9, 64, 5120, 8, 128),
    "qwen2.5-1.5b": ModelShape(1.5e9, 28, 1536, 2, 128),
    # sluice's embedded tiny Llama (tasks/tiny_model.py) in float32 on the CPU.
    "tiny": ModelShape(0.86e6, 4, 128, 4, 32, bytes_per_param=4.0),
}


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or host): peaks and price."""

    name: str
    peak_flops: float
    """Dense BF16 FLOP/s (FP32 for the CPU)."""
    mem_bw: float
    """Memory bandwidth, bytes/s."""
    memory: float
    """Device memory, bytes."""
    cost_per_hour: float
    """Price of one device-hour (USD)."""
    link_bw: float = 50e9
    """Bytes/s a weight transfer to or from this device reaches (NIC / host link)."""


DEVICES: dict[str, DeviceSpec] = {
    "H100": DeviceSpec("H100", 989e12, 3.35e12, 80 * GB, 2.5),
    "H800": DeviceSpec("H800", 989e12, 3.35e12, 80 * GB, 2.2),
    "H200": DeviceSpec("H200", 989e12, 4.8e12, 141 * GB, 3.5),
    "A100": DeviceSpec("A100", 312e12, 2.0e12, 80 * GB, 1.3),
    "H20": DeviceSpec("H20", 148e12, 4.0e12, 96 * GB, 1.0),
    "910B": DeviceSpec("910B", 313e12, 1.6e12, 64 * GB, 1.2, link_bw=25e9),
    # Measured on the project machine (2 cores, FP32 matmul and a large copy: harness/fit.py's measure_host).
    "cpu": DeviceSpec("cpu", 1.04e11, 3.8e10, 8 * GB, 0.05, link_bw=4e9),
}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak each phase reaches, and fixed costs: what profiling refines."""

    decode_bw: float = 0.6
    """Fraction of memory bandwidth a decode iteration reaches reading weights and KV."""
    decode_flops: float = 0.3
    prefill_flops: float = 0.5
    train_flops: float = 0.4
    """Training MFU."""
    decode_overhead_s: float = 0.004
    """Fixed cost of one decode iteration (scheduling, kernel launches)."""
    microbatch_overhead_s: float = 0.02
    load_overhead_s: float = 0.5
    """Fixed cost of loading new weights into a replica."""


def analytic_memory_bound_s(model: ModelShape, device: DeviceSpec, tp: int, eff: Efficiency) -> float:
    """Reading the weights once on ``tp`` devices: the flat part of a decode iteration."""
    return model.weight_bytes / (device.mem_bw * tp * eff.decode_bw)


@dataclass(frozen=True)
class CostModel:
    """Phase times of ``model`` on ``device`` (see the module docstring)."""

    model: ModelShape
    device: DeviceSpec
    eff: Efficiency = Efficiency()

    def decode_per_seq_s(self, context: float, tp: int = 1) -> float:
        """Marginal cost of one more sequence in a decode iteration with ``context`` tokens."""
        compute = 2.0 * self.model.params / (self.device.peak_flops * tp * self.eff.decode_flops)
        kv = context * self.model.kv_bytes_per_token / (self.device.mem_bw * tp * self.eff.decode_bw)
        return compute + kv

    def decode_s(self, tp: int = 1) -> float:
        """A decode iteration while the batch is small (memory-bound)."""
        return analytic_memory_bound_s(self.model, self.device, tp, self.eff) + self.eff.decode_overhead_s

    def max_running(self, context: float, tp: int = 1) -> int:
        """Sequences whose KV cache fits beside the weights (90 % of memory usable)."""
        free = 0.9 * self.device.memory * tp - self.model.weight_bytes
        if free <= 0:
            return 0
        return int(free / (max(context, 1.0) * self.model.kv_bytes_per_token))

    def prefill_s_per_token(self, tp: int = 1) -> float:
        return 2.0 * self.model.params / (self.device.peak_flops * tp * self.eff.prefill_flops)

    def load_s(self) -> float:
        return self.model.weight_bytes / self.device.link_bw + self.eff.load_overhead_s

    def engine_config(self, tp: int, lengths: LengthModel, prompt_len: int, cap: int | None = None) -> SimEngineConfig:
        """``SimEngine`` parameters of one replica on ``tp`` devices, at the mean context of a
        response drawn from ``lengths`` (prompt + half the response on average)."""
        context = prompt_len + 0.5 * lengths.median * _lognormal_mean_factor(lengths)
        decode = self.decode_s(tp)
        knee = max(1, round(decode / self.decode_per_seq_s(context, tp)))
        running = self.max_running(prompt_len + lengths.median * _lognormal_mean_factor(lengths), tp)
        if running < 1:
            raise ValueError(f"{self.model} does not fit on {tp} x {self.device.name}")
        return SimEngineConfig(
            decode_s=decode,
            knee=knee,
            max_running=min(running, cap) if cap else running,
            prefill_s_per_token=self.prefill_s_per_token(tp),
            load_s=self.load_s(),
            lengths=lengths,
        )

    def train_token_s(self, devices: int, forwards: int = 0) -> float:
        """Seconds per trained token on ``devices`` data-parallel devices; ``forwards`` extra
        forward passes per token (proximal / reference log-probs)."""
        flops = (6.0 + 2.0 * forwards) * self.model.params
        return flops / (self.device.peak_flops * devices * self.eff.train_flops)

    def optimizer_s(self, devices: int) -> float:
        """Parameters, gradients and two Adam moments (FP32) read and written once, sharded."""
        return 2.0 * 16.0 * self.model.params / (self.device.mem_bw * devices * self.eff.decode_bw)

    def max_microbatch_tokens(self, devices: int) -> int:
        """Tokens whose activations fit after the FSDP-sharded training state (16 bytes per
        parameter): with activation checkpointing, each layer keeps its BF16 input
        (``2·hidden`` bytes per token) and the layer being recomputed ~``34·hidden``."""
        free = 0.9 * self.device.memory - 16.0 * self.model.params / devices
        per_token = self.model.hidden * (2.0 * self.model.layers + 34.0)
        return max(0, int(free / per_token))


@dataclass(frozen=True)
class TrainerCost:
    """Simulated trainer: each micro-batch of up to ``micro_batch_tokens`` tokens costs
    ``microbatch_overhead_s + tokens · token_s``; every step ends with ``step_s``."""

    token_s: float
    """Seconds per trained token (prompt tokens included); with ``alone_speedup`` > 1, the rate
    while generation runs beside the trainer."""
    microbatch_overhead_s: float = 0.0
    """Fixed seconds per micro-batch."""
    micro_batch_tokens: int = 8192
    """Token budget of one micro-batch."""
    step_s: float = 0.0
    """The optimizer step and weight publish that end a step."""
    alone_speedup: float = 1.0
    """How many times faster the trainer works while no replica generates, for a trainer that
    shares its device with generation (this CPU: its rate alone over its rate beside decoding,
    each measured). 1: the stages have devices of their own (every accelerator preset), so
    generation never slows training."""

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.alone_speedup <= 0:
            raise ValueError(f"alone_speedup must be > 0, got {self.alone_speedup}")


def trainer_cost(cost: CostModel, devices: int, micro_batch_tokens: int, forwards: int = 0) -> TrainerCost:
    """The trainer on ``devices`` devices; the optimizer step and the weight publish end a step."""
    limit = cost.max_microbatch_tokens(devices)
    if micro_batch_tokens > limit:
        raise ValueError(f"micro_batch_tokens={micro_batch_tokens} exceeds the memory limit {limit}")
    return TrainerCost(
        token_s=cost.train_token_s(devices, forwards),
        microbatch_overhead_s=cost.eff.microbatch_overhead_s,
        micro_batch_tokens=micro_batch_tokens,
        step_s=cost.optimizer_s(devices) + cost.model.weight_bytes / cost.device.link_bw,
    )


def _lognormal_mean_factor(lengths: LengthModel) -> float:
    """Mean / median of the response length (log-normal with both spreads)."""
    import math

    return math.exp(0.5 * (lengths.prompt_sigma**2 + lengths.sample_sigma**2))

"""Config sections of the services the rollout talks to: external inference engines (vLLM,
SGLang) and the reward service. ``config/models.py`` assembles them into a run's config; this
module only declares and validates.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from sluice.config.section import Section as _Section


class VLLMConfig(_Section):
    kv_cache_mb: int = Field(default=256, ge=1)
    """KV-cache size in MiB, set explicitly (vLLM's own sizing misreads the free memory of some CPU
    hosts). Raise it for long responses or large batches; on GPU use several GiB, or size by
    ``gpu_memory_utilization`` instead."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations. ``float32`` matches the trainer's log-probs closely;
    ``bfloat16`` is faster on GPUs and AMX CPUs at the cost of larger behaviour/proximal gaps."""

    max_model_len: int | None = Field(default=None, ge=1)
    """Longest prompt + response in tokens (``null``: the model config's maximum)."""

    enforce_eager: bool | None = None
    """Skip torch.compile / CUDA graphs. ``null``: true on CPU (compiling costs ~30 s there and
    gains nothing), false on GPU."""

    weight_transfer: Literal["memory", "folder"] = "memory"
    """How each new weight version reaches vLLM: ``memory`` sends the tensors to vLLM's workers
    and reloads from them (no file written); ``folder`` writes them to a folder under
    ``weights_dir`` and reloads that by path (what SGLang does; kept for comparison,
    benchmarks/weight_sync.py)."""

    weights_dir: str = "/dev/shm"
    """Where the untied copy of a tied-embedding model that vLLM starts from is written, and with
    ``weight_transfer: folder`` every weight update (tmpfs: RAM, no disk I/O)."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """Ranks one vLLM engine shards the model over (vLLM's tensor parallelism). On GPU each rank
    is a GPU visible to the rollout worker; on CPU vLLM runs one rank per NUMA node, so more ranks
    than NUMA nodes are refused unless ``VLLM_CPU_OMP_THREADS_BIND`` gives each rank's cores."""

    gpu_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0)
    """Fraction of each GPU's memory vLLM may take (weights, activations and KV cache); when set,
    the KV cache gets what is left and ``kv_cache_mb`` is not used. ``null``: the KV cache is
    ``kv_cache_mb``. GPU only (refused on CPU)."""


class SGLangConfig(_Section):
    url: str = "http://127.0.0.1:30000"
    """Base URL of a running SGLang server (``python -m sglang.launch_server --model-path ...``)
    serving the same model folder."""

    weights_dir: str = "/dev/shm"
    """Where weight updates are written for ``/update_weights_from_disk``; the server must see
    the same path (same machine, or a shared filesystem)."""

    timeout_s: float = Field(default=600.0, gt=0.0)
    """Per-HTTP-call limit in seconds (a whole generation is one call)."""


BUILTIN_REWARDS = ("exact_match", "math_verify", "code_exec")
"""The names ``reward.name`` and ``reward.by_source`` accept (``sluice.rewards.REWARDS``)."""

IMPORT_PATH = re.compile(r"([A-Za-z_]\w*(\.[A-Za-z_]\w*)*|[^:]+\.py):[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
"""``package.module:function`` or ``path/to/file.py:function`` (the attribute may be dotted:
``module:Class.method``)."""


def _reward_ref(field: str, value: str) -> str:
    """A built-in name or an import path; anything else names ``field``."""
    if value in BUILTIN_REWARDS or IMPORT_PATH.fullmatch(value):
        return value
    raise ValueError(
        f"{field}: {value!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) "
        "nor an import path package.module:function or path/to/file.py:function"
    )


class RewardConfig(_Section):
    name: Literal["exact_match", "math_verify", "code_exec"] | None = None
    """Built-in reward function: ``null`` uses ``fn`` if set, else the task's own (or the one passed
    to ``RLTrainer``); ``exact_match`` (response equals the row's ``answer``), ``math_verify``
    (mathematically equal to ``answer``; needs ``pip install 'sluice[math]'``), ``code_exec`` (the
    fraction of the row's ``tests`` that the response's Python code passes, judged in a sandbox;
    the ``sandbox_*`` and ``code_exec_scoring`` options). See docs/rewards.md."""

    fn: str | None = None
    """Your own reward by import path, ``package.module:function`` (importable where the run starts;
    checked there), or by file, ``path/to/file.py:function`` (relative to the config file that
    names it, or to the working directory on the command line). Called as ``fn(response,
    **fields)`` (the row's fields: ``answer``, ``data_source``, ``data.fields``), or
    verl-style ``fn(data_source, solution_str, ground_truth, extra_info)`` when it has a
    parameter named ``solution_str``. Exclusive with ``name``."""

    by_source: dict[str, str] = Field(default_factory=dict)
    """Reward per data source, ``{data_source: reward}`` (a built-in name or an import path), like
    verl's ``default_compute_score``: each row goes by its ``data_source`` field
    (``data.data_source_key``; ``default`` when absent). A source without an entry uses ``fn`` /
    ``name``; with neither set its rows are reward failures naming the source."""

    format_pattern: str | None = None
    """A regular expression the whole response must match (``re.fullmatch``), e.g.
    ``(?s).*\\\\boxed\\{.+\\}.*``. A response that does not scores ``format_score`` (its base
    reward is not computed); one that does scores its base reward. ``null``: off."""

    format_score: float = 0.0
    """The reward of a response that does not match ``format_pattern`` (e.g. -1.0 ranks it below
    a wrong answer of a 0/1 reward)."""

    overlong_buffer: int = Field(default=0, ge=0)
    """DAPO's soft overlong punishment: the last ``L_cache`` tokens before
    ``rollout.max_new_tokens`` (``L_max``). A training response of ``n`` tokens gets
    ``((L_max - L_cache) - n) / L_cache * overlong_penalty`` added when
    ``L_max - L_cache < n <= L_max``, ``-overlong_penalty`` past ``L_max``, nothing otherwise.
    Single-turn rollouts only; evaluation is not penalised. 0: off."""

    overlong_penalty: float = Field(default=1.0, ge=0.0)
    """The overlong punishment's factor: the penalty at ``n = L_max``."""

    latency_s: float = Field(default=0.0, ge=0.0)
    """μ: seconds each reward call waits before it is scored, as a remote reward service would (a
    waiting-bound workload: ``sluice bench e2e --workload reward-wait``), drawn per call from a
    Gaussian of mean μ and standard deviation μ, clipped at 0 (ROLL Flash's simulated-environment
    setting); the wait uses no CPU. 0: none."""

    pool_size: int = Field(default=2, ge=0)
    """Reward worker processes per rollout worker, so scoring never blocks generation. 0 runs
    the reward in a thread of the rollout worker (for rewards that cannot be pickled, e.g.
    closures; a hung call then leaks its thread)."""

    start_method: Literal["forkserver", "spawn"] = "forkserver"
    """How reward processes start (never ``fork``: the parent runs torch threads). ``spawn``
    where forkserver is unavailable."""

    timeout_s: float = Field(default=30.0, gt=0.0)
    """Per-call reward timeout: a call still running is killed, counted as
    ``reward_timeout:<name>`` and its group discarded with that reason."""

    sandbox_isolation: Literal["bwrap", "unshare"] = "bwrap"
    """``code_exec``: how programs are walled in. ``bwrap``: a bubblewrap jail (every namespace
    unshared, uid 65534 with no capabilities, a read-only root holding the Python standard library
    only, a private ``/tmp``, pids and memory cgroups; ``make sandbox-deps`` installs it); where
    bubblewrap cannot run, the run stops at start with ``SandboxUnavailable`` naming the cause.
    ``unshare``: the weak mode, chosen by name: a private network namespace only (``unshare
    -rn``), no filesystem jail, no process bound, signals reach the host's processes and even the
    scoring can be forged; trusted code only. See docs/rewards.md."""

    sandbox_processes: int = Field(default=64, ge=1, strict=True)
    """``code_exec``: most processes (threads included) alive at once in one sandbox (a pids
    cgroup; ``RLIMIT_NPROC`` does not bind root). Where no pids cgroup is writable, or in
    ``unshare`` isolation, nothing bounds it before the wall-time kill."""

    sandbox_cpu_s: int = Field(default=5, ge=1)
    """``code_exec``: CPU seconds each process of a sandbox may use (``RLIMIT_CPU``: SIGXCPU,
    then SIGKILL); the tests still running then fail."""

    sandbox_memory_mb: int = Field(default=512, ge=16)
    """``code_exec``: memory of one sandbox in MiB: a memory cgroup over its whole process tree,
    the address space of each process (``RLIMIT_AS``: an allocation past it raises
    ``MemoryError``), and the size of its private ``/tmp``. A call runs two sandboxes (the
    solution and the judge), each with this limit. Where no memory cgroup is writable, or in
    ``unshare`` isolation, only the per-process ``RLIMIT_AS`` applies."""

    sandbox_wall_s: float = Field(default=10.0, gt=0.0)
    """``code_exec``: wall-clock seconds for one call, its two sandboxes together (one deadline);
    then every process of both is killed (in ``bwrap`` isolation ``setsid`` escapees too: the pid
    namespace dies with its init) and the tests not yet reported fail. Must be below
    ``timeout_s``."""

    sandbox_output_kb: int = Field(default=1024, ge=1)
    """``code_exec``: largest file a sandboxed process may write, in KiB (``RLIMIT_FSIZE``): its
    stdout / stderr and files in its ``/tmp``."""

    sandbox_network: Literal["isolate", "allow"] = "isolate"
    """``code_exec``: ``isolate`` gives each sandbox a network namespace of its own (a loopback of
    its own, no other device: no TCP / UDP to anywhere, no abstract Unix socket of the host; in
    ``unshare`` isolation this is ``unshare -rn``). ``allow`` shares the host's network, its
    loopback and abstract Unix sockets included (trusted code only)."""

    code_exec_scoring: Literal["fraction", "all"] = "fraction"
    """``code_exec``: ``fraction`` scores tests passed / total (partial credit); ``all`` scores 1.0
    only when every test passes, else 0.0. A test is each top-level statement of the row's
    ``tests`` holding an ``assert``, and each ``test_*`` function."""

    model: str | None = None
    """A scalar reward model: an HF folder of a ``...ForSequenceClassification`` with one label
    (``sluice rm`` writes one). Its workers (``resources.reward_model``) score every finished
    group, in batches, before the group's filters run; ``combine`` says how its score meets the
    rule reward. A path that is not such a folder is refused at start. ``null``: none."""

    combine: Literal["sum", "model"] = "sum"
    """With ``model``: ``sum`` trains on ``rule_weight · rule + model_weight · rm`` (the rule reward:
    ``name`` / ``fn`` / ``by_source`` / the task's); ``model`` trains on the reward model's score
    alone (the rule reward is not called in training; it still scores evaluation)."""

    model_weight: float = 1.0
    """The reward model's weight in ``combine: sum`` (and its scale in ``combine: model``)."""

    rule_weight: float = 1.0
    """The rule reward's weight in ``combine: sum``."""

    model_normalize: bool = False
    """Normalise the reward model's scores by their running mean and standard deviation (every
    score seen so far in the run, its group's included) before combining; counted as
    ``rm_normalised`` with the running ``rm_running_mean`` / ``rm_running_std``."""

    model_token_budget: int = Field(default=4096, ge=1)
    """Padded positions per reward-model forward; groups that finish together share a batch up to
    this many tokens."""

    model_timeout_s: float = Field(default=300.0, gt=0.0)
    """A reward-model worker actor's call past this is a failure of its batch (the actor is replaced
    and the batch run once more)."""

    judge: str | None = None
    """An LLM judge: an HF causal LM folder whose greedy answer to ``judge_template`` is parsed into
    each response's score (``judge_parser``); it scores groups like ``model`` (the same
    ``combine`` and ``model_weight``), in the built-in engine in the rollout worker's process, its
    weights never changing. An answer the parser cannot read fails the group
    (``reward_invalid:judge``, counted as ``judge_garbage``), never a silent 0. Exclusive with
    ``model``. ``null``: none."""

    judge_template: str = "{prompt}{response}"
    """The judge's prompt: ``{prompt}`` (as the policy saw it) and ``{response}`` are filled in."""

    judge_parser: Literal["number", "verdict", "choice"] = "number"
    """How the judge's answer becomes a score: ``number`` (its first number), ``verdict`` (yes / no,
    true / false, pass / fail, correct / incorrect → 1 / 0), ``choice`` (its first word in
    ``judge_choices``)."""

    judge_choices: dict[str, float] = Field(default_factory=dict)
    """``judge_parser: choice``: each answer word's score (e.g. ``{A: 1.0, B: 0.0}``)."""

    judge_max_new_tokens: int = Field(default=16, ge=1)
    """The longest judge answer in tokens."""

    @model_validator(mode="after")
    def _combine_needs_a_model(self) -> RewardConfig:
        if self.combine == "model" and self.model is None and self.judge is None:
            raise ValueError("reward.combine: 'model' trains on a reward model's score; set reward.model or judge")
        if self.model is not None and self.judge is not None:
            raise ValueError("reward.model and reward.judge exclude each other: set one")
        if self.judge_parser == "choice" and self.judge is not None and not self.judge_choices:
            raise ValueError("reward.judge_parser: 'choice' needs reward.judge_choices ({word: score})")
        return self

    @field_validator("fn")
    @classmethod
    def _fn_is_a_path(cls, value: str | None) -> str | None:
        if value is not None and not IMPORT_PATH.fullmatch(value):
            raise ValueError(
                f"reward.fn: {value!r} is not an import path package.module:function "
                "nor a file path/to/file.py:function"
            )
        return value

    @field_validator("by_source")
    @classmethod
    def _sources_are_rewards(cls, value: dict[str, str]) -> dict[str, str]:
        return {source: _reward_ref(f"reward.by_source.{source}", ref) for source, ref in value.items()}

    @field_validator("format_pattern")
    @classmethod
    def _pattern_compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as err:
                raise ValueError(f"reward.format_pattern: not a regular expression: {err}") from None
        return value

    @model_validator(mode="after")
    def _one_base_reward(self) -> RewardConfig:
        if self.name is not None and self.fn is not None:
            raise ValueError(f"reward.name ({self.name!r}) and reward.fn ({self.fn!r}) exclude each other: set one")
        return self

    @model_validator(mode="after")
    def _sandbox_inside_timeout(self) -> RewardConfig:
        code_exec = self.name == "code_exec" or "code_exec" in self.by_source.values()
        if code_exec and self.sandbox_wall_s >= self.timeout_s:
            raise ValueError(
                f"reward.sandbox_wall_s ({self.sandbox_wall_s}) must be below reward.timeout_s ({self.timeout_s})"
            )
        return self

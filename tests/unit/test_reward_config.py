"""``reward.*`` config → the reward a run scores with: ``sluice train``'s own path
(``load_config`` → ``build_reward_service``, as ``RolloutWorker`` and ``RLTrainer`` call it)."""

import asyncio

import pytest

from sluice.config import ConfigError, RewardConfig, load_config, validate_config
from sluice.rewards import CodeExecReward, SandboxLimits, SandboxUnavailable, build_reward_service, sandbox_limits
from sluice.rewards.jail import bwrap_problem

needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap sandbox: {bwrap_problem()}")

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15"
TWO_OF_THREE = "```python\ndef add(a, b):\n    return a + b if a > 0 else 99\n```"  # passes tests 1 and 3
CONFIG = """\
reward:
  name: code_exec
  pool_size: 1
  timeout_s: 20
  sandbox_isolation: bwrap
  sandbox_processes: 16
  sandbox_cpu_s: 2
  sandbox_memory_mb: 256
  sandbox_wall_s: 8
  sandbox_output_kb: 64
  sandbox_network: isolate
"""


def _config(tmp_path, *overrides):
    """What ``sluice train config.yaml key=value ...`` validates (``cli._train`` calls ``load_config``)."""
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    return load_config(path, list(overrides))


def _score(service, response):
    async def go():
        return await service(response, tests=TESTS)

    return asyncio.run(go())


def test_every_sandbox_option_reaches_the_limits(tmp_path):
    cfg = _config(tmp_path, "reward.code_exec_scoring=all")
    assert sandbox_limits(cfg.reward) == SandboxLimits(
        cpu_s=2, memory_mb=256, wall_s=8.0, output_kb=64, network="isolate", processes=16, isolation="bwrap"
    )
    weak = _config(tmp_path, "reward.sandbox_isolation=unshare", "reward.sandbox_network=allow").reward
    assert sandbox_limits(weak).isolation == "unshare" and sandbox_limits(weak).network == "allow"


def test_config_defaults_are_the_sandbox_defaults():
    cfg = RewardConfig()
    assert sandbox_limits(cfg) == SandboxLimits()
    assert cfg.code_exec_scoring == CodeExecReward().scoring == "fraction"


@needs_bwrap
@pytest.mark.parametrize(("scoring", "expected"), [("fraction", 2 / 3), ("all", 0.0)])
def test_code_exec_scoring_from_the_config(tmp_path, scoring, expected):
    """The service a run builds (a reward pool process) scores a 2-of-3 program by the option."""
    cfg = _config(tmp_path, f"reward.code_exec_scoring={scoring}")
    service = build_reward_service(cfg.reward, default=lambda response, **_: 0.0)
    try:
        assert service.fn == CodeExecReward(sandbox_limits(cfg.reward), scoring=scoring)
        assert _score(service, TWO_OF_THREE) == pytest.approx(expected)
        assert _score(service, "def add(a, b):\n    return a + b") == 1.0
    finally:
        service.close()


@needs_bwrap
def test_the_process_bound_from_the_config_holds(tmp_path):
    """``sandbox_processes`` reaches the pids cgroup: 40 threads in a sandbox of 16 fail the test."""
    from host_probes import cgroups_available

    if not cgroups_available():
        pytest.skip("no writable pids / memory cgroups here")
    cfg = _config(tmp_path, "reward.pool_size=0")
    fn = build_reward_service(cfg.reward, default=lambda response, **_: 0.0).fn
    threads = (
        "import threading, time\n"
        "def spawn(n):\n"
        "    started = []\n"
        "    for _ in range(n):\n"
        "        t = threading.Thread(target=time.sleep, args=(2,), daemon=True)\n"
        "        t.start()\n"
        "        started.append(t)\n"
        "    return len(started)\n"
    )
    assert fn(threads, tests="assert spawn(4) == 4") == 1.0
    assert fn(threads, tests="assert spawn(40) == 40") == 0.0


def test_without_bubblewrap_a_run_stops_at_start(tmp_path, monkeypatch):
    """No sandbox here: building the reward raises, naming the opt-in, instead of every call failing."""
    monkeypatch.setattr("sluice.rewards.sandbox.bwrap_problem", lambda: "bubblewrap is not installed")
    cfg = _config(tmp_path)
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap is not installed.*reward\.sandbox_isolation=unshare"):
        build_reward_service(cfg.reward, default=lambda response, **_: 0.0)
    weak = _config(tmp_path, "reward.sandbox_isolation=unshare", "reward.sandbox_network=allow", "reward.pool_size=0")
    service = build_reward_service(weak.reward, default=lambda response, **_: 0.0)
    assert service.fn.limits.isolation == "unshare"  # chosen by name: built, bwrap never asked


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("sandbox_isolation", "none", "sandbox_isolation"),
        ("sandbox_processes", 0, "greater than or equal to 1"),
        ("sandbox_processes", "8", "valid integer"),
        ("sandbox_processes", True, "valid integer"),
        ("sandbox_processes", 8.0, "valid integer"),
        ("code_exec_scoring", "most", "code_exec_scoring"),
    ],
)
def test_bad_sandbox_options_are_config_errors(key, value, message):
    with pytest.raises(ConfigError, match=message):
        validate_config({"reward": {"name": "code_exec", key: value}})


def test_a_reward_by_file_path_relative_to_the_config_runs_in_the_pool(tmp_path, monkeypatch):
    """verl's habit: ``reward.fn: my_rewards.py:fn`` beside the config, from another directory;
    the pool's processes import the file too, and a ``bool`` result scores 1 / 0."""
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "my_rewards.py").write_text("def fn(response, answer='', **_):\n    return response == answer\n")
    (folder / "run.yaml").write_text("reward:\n  fn: my_rewards.py:fn\n  pool_size: 1\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(folder / "run.yaml")
    assert cfg.reward.fn == f"{(folder / 'my_rewards.py').resolve()}:fn"
    service = build_reward_service(cfg.reward, None)
    try:
        assert asyncio.run(service("7", answer="7")) == 1.0
        assert asyncio.run(service("8", answer="7")) == 0.0
    finally:
        service.close()


def test_an_unimportable_reward_says_where_it_looked_and_how_to_fix_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        build_reward_service(load_config(None, ["reward.fn=my_rewards:fn"]).reward, None)
    assert f"looked on the Python path from {tmp_path}" in str(err.value)
    assert "reward.fn=path/to/my_rewards.py:fn" in str(err.value)
    with pytest.raises(ConfigError, match=r"reward file '.*missing\.py' not found \(looked at"):
        build_reward_service(load_config(None, ["reward.fn=missing.py:fn"]).reward, None)

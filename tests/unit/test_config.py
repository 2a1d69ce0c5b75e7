from pathlib import Path

import pytest
import yaml

from sluice.config import ConfigError, SluiceConfig, dump_config, load_config
from sluice.config.models import RolloutConfig, RunConfig
from sluice.config.reference import config_reference

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_dotted_overrides():
    cfg = load_config(None, ["rollout.group_size=4", "trainer.lr=1e-3", "run.name=abc", "trainer.betas=[0.8, 0.9]"])
    assert cfg.rollout.group_size == 4
    assert cfg.trainer.lr == pytest.approx(1e-3)
    assert cfg.run.name == "abc"
    assert cfg.trainer.betas == (0.8, 0.9)


def test_yaml_file_then_overrides_win(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("rollout:\n  group_size: 3\n  prompts_per_step: 5\n")
    cfg = load_config(path, ["rollout.group_size=7"])
    assert (cfg.rollout.group_size, cfg.rollout.prompts_per_step) == (7, 5)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["rollout.foo=1"], "rollout.foo: unknown key (allowed: group_size"),
        (["nope=1"], "nope: unknown key"),
        (["rollout.group_size=abc"], "rollout.group_size: Input should be a valid integer"),
        (["rollout.group_size=0"], "rollout.group_size: Input should be greater than or equal to 1"),
        (["run.mode=bogus"], "run.mode"),
        (["rollout"], "expected dotted.key=value"),
        (["rollout.group_size=true"], "rollout.group_size: Input should be a valid integer, got a boolean"),
        (["rollout.group_size=2.0"], "rollout.group_size: Input should be a valid integer, got a float"),
        (["rollout.max_new_tokens=false"], "rollout.max_new_tokens: Input should be a valid integer, got a boolean"),
        (["rollout.temperature=true"], "rollout.temperature: Input should be a valid number, got a boolean"),
        (["trainer.betas=[0.9, true]"], "trainer.betas: item 2: Input should be a valid number, got a boolean"),
    ],
)
def test_bad_config_names_the_field(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_numbers_stay_what_they_are():
    cfg = load_config(None, ["trainer.lr=1", "trainer.betas=[1, 0.9]", "rollout.max_new_tokens=null", "run.trace=true"])
    assert cfg.trainer.lr == 1.0 and cfg.trainer.betas == (1.0, 0.9) and cfg.rollout.max_new_tokens is None


def test_non_utf8_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"run:\n  name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1.yaml line 2: not UTF-8 text \(byte 0xe9\)"):
        load_config(path)


def test_every_shipped_config_still_loads():
    paths = [*REPO.glob("examples/*/config.yaml"), *REPO.glob("examples/*.yaml")]
    assert len(paths) >= 3
    for path in paths:
        load_config(path)


def test_dump_roundtrips():
    cfg = load_config(None, ["run.steps=3"])
    import yaml

    assert SluiceConfig.model_validate(yaml.safe_load(dump_config(cfg))) == cfg


def test_every_field_is_documented():
    for section in SluiceConfig.model_fields.values():
        assert section.description, section
        for name, field in section.annotation.model_fields.items():  # type: ignore[union-attr]
            assert field.description, f"{name} has no docstring"


def test_config_reference_is_current():
    assert (REPO / "docs" / "config.md").read_text().strip() == config_reference().strip(), (
        "docs/config.md is stale: run `.venv/bin/sluice config-docs > docs/config.md`"
    )


def test_sync_is_eta_zero_and_refuses_only_what_needs_overlap():
    sync = [
        "run.mode=sync",
        "resources.rollout.replicas=2",
        "rollout.redundant_groups=4",
        "rollout.filter_groups=zero_signal",
    ]
    cfg = load_config(
        None,
        [*sync, "rollout.engine=vllm", "agentic.env=calculator", "resources.trainer.ranks=2", "trainer.strategy=ddp"],
    )
    assert cfg.rollout.max_staleness == 0 and cfg.resources.rollout.replicas == 2 and cfg.resources.trainer.ranks == 2
    assert load_config(None, ["run.mode=sync", "rollout.max_staleness=0"]).rollout.max_staleness == 0
    with pytest.raises(ConfigError, match=r"rollout\.max_staleness: run\.mode=sync trains on-policy"):
        load_config(None, ["run.mode=sync", "rollout.max_staleness=2"])
    with pytest.raises(ConfigError, match=r"rollout\.forced_lag: .* needs run\.mode=async"):
        load_config(None, ["run.mode=sync", "rollout.forced_lag=true"])
    assert load_config(None, []).rollout.max_staleness == 1  # async keeps its default bound
    built = SluiceConfig(run=RunConfig(mode="sync"), rollout=RolloutConfig(group_size=4))  # sections as models
    assert built.rollout.max_staleness == 0 and built.rollout.group_size == 4
    with pytest.raises(ValueError, match=r"rollout\.max_staleness: run\.mode=sync"):
        SluiceConfig(run=RunConfig(mode="sync"), rollout=RolloutConfig(max_staleness=2))
    cfg = load_config(None, ["resources.rollout.replicas=2", "rollout.redundant_groups=16", "rollout.scheduling=batch"])
    assert (cfg.resources.rollout.replicas, cfg.rollout.redundant_groups, cfg.rollout.scheduling) == (2, 16, "batch")


def test_data_parallel_takes_ppo_updates_and_a_critic():
    dp = ["run.mode=async", "run.backend=ray", "resources.trainer.ranks=2", "trainer.strategy=ddp"]
    updates = ["trainer.ppo_mini_batches=4", "trainer.ppo_epochs=2", "trainer.prox_logprobs=recompute"]
    assert load_config(None, [*dp, *updates]).trainer.ppo_mini_batches == 4
    assert load_config(None, [*dp, "trainer.algorithm=ppo"]).trainer.algorithm == "ppo"
    assert load_config(None, [*dp[:-1], "trainer.strategy=fsdp2", "trainer.algorithm=ppo"]).trainer.strategy == "fsdp2"
    with pytest.raises(ConfigError, match=r"needs run\.backend: ray"):
        load_config(None, ["resources.trainer.ranks=2", "trainer.strategy=ddp", "run.backend=local"])
    with pytest.raises(ConfigError, match=r"resources\.trainer\.ranks=2 needs trainer\.strategy: ddp or fsdp2"):
        load_config(None, ["resources.trainer.ranks=2", "run.backend=ray"])


MOVED_OPTIONS = [
    ("trainer", "data_parallel", 2, "resources.trainer.ranks"),
    ("run", "trainer_threads", 2, "resources.trainer.threads"),
    ("run", "rollout_threads", 2, "resources.rollout.threads"),
    ("rollout", "replicas", 2, "resources.rollout.replicas"),
    ("fleet", "replica_actors", True, "resources.rollout.replica_actors"),
]


@pytest.mark.parametrize(("section", "name", "value", "new"), MOVED_OPTIONS)
def test_a_moved_option_is_refused_naming_its_replacement(tmp_path, section, name, value, new):
    want = f"^{section}\\.{name} was moved: use {new.replace('.', chr(92) + '.')}$"
    with pytest.raises(ConfigError, match=want):
        load_config(None, [f"{section}.{name}={value}"])
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({section: {name: value}}))
    with pytest.raises(ConfigError, match=want):
        load_config(path)
    dotted = new.split(".")
    cfg = load_config(None, [f"{new}={value}", "trainer.strategy=ddp"])  # ddp: two ranks need a group
    assert getattr(getattr(cfg.resources, dotted[1]), dotted[2]) == value


def test_dtype_fields_take_the_short_names():
    cfg = load_config(None, ["trainer.dtype=bf16", "rollout.dtype=fp32", "vllm.dtype=fp16"])
    assert (cfg.trainer.dtype, cfg.rollout.dtype, cfg.vllm.dtype) == ("bfloat16", "float32", "float16")
    with pytest.raises(ConfigError, match=r"trainer\.dtype"):  # an alias only for a name the field takes
        load_config(None, ["trainer.dtype=fp16"])
    with pytest.raises(ConfigError, match=r"run\.mode"):  # and only on dtype fields
        load_config(None, ["run.mode=bf16"])


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.n is sluice's rollout.group_size"),
        ("data.train_batch_size=16", "data.train_batch_size is sluice's rollout.prompts_per_step"),
        ("trainer.total_epochs=3", "trainer.total_epochs is sluice's run.epochs"),
        ("custom_reward_function.path=r.py", "reward.fn: path/to/file.py:function"),
        ("trainer.logger=[wandb]", "trainer.logger is sluice's tracking.trackers"),
        ("num_generations=8", "num_generations is sluice's rollout.group_size"),
        ("rollout.n=8", "rollout.n is sluice's rollout.group_size"),
        ("rollout.group_sise=8", "rollout.group_sise: unknown key (did you mean group_size?)"),
    ],
)
def test_an_unknown_key_names_the_sluice_key(override, says):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert says in str(err.value)


def _resolves(dotted: str) -> bool:
    model = SluiceConfig
    for part in dotted.split("."):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return False
        model = field.annotation
    return True


def test_the_peer_names_table_points_at_real_keys_and_covers_the_readme():
    from sluice.config.peer_names import PEER_NAMES

    for peer, ours in PEER_NAMES.items():
        assert _resolves(ours.split()[0].rstrip(":")), f"{peer} -> {ours}"
    table = REPO.joinpath("README.md").read_text().split("**Coming from verl or TRL.**")[1].split("\n\n")[1]
    import re

    for row in table.splitlines()[2:]:
        verl = row.split("|")[1]
        for key in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)", verl):
            assert _resolves(key) or key in PEER_NAMES, f"README's verl key {key} is neither sluice's nor in PEER_NAMES"


def test_run_epochs_excludes_run_steps_and_its_warmup_must_fit_the_derived_steps():
    from sluice.config import steps_of_epochs

    with pytest.raises(ConfigError, match=r"run\.epochs \(2\) and run\.steps \(5\) exclude each other"):
        load_config(None, ["run.epochs=2", "run.steps=5"])
    cfg = steps_of_epochs(load_config(None, ["run.epochs=1.5", "rollout.prompts_per_step=8"]), 20)
    assert (cfg.run.steps, cfg.run.epochs) == (4, None)  # ceil(1.5 × 20 / 8)
    warm = load_config(None, ["run.epochs=1", "rollout.prompts_per_step=8", "trainer.lr_warmup_steps=5"])
    with pytest.raises(ConfigError, match=r"trainer\.lr_warmup_steps \(5\) exceeds run\.steps \(2\)"):
        steps_of_epochs(warm, 16)


@pytest.mark.parametrize("name", ["../x", "/tmp/elsewhere", "a/../../x", ".", ""])
def test_a_run_name_outside_the_output_dir_is_refused_in_one_line(name):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"run.name={name}"])
    line = str(err.value)
    assert "\n" not in line and "must be a folder name inside run.output_dir" in line
    assert load_config(None, ["run.name=team/exp1"]).run.name == "team/exp1"  # a sub-folder stays inside


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_one_sample_groups_with_a_group_relative_estimator_are_refused_naming_both_keys(algorithm):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.group_size=1", f"trainer.algorithm={algorithm}"])
    line = str(err.value)
    assert "\n" not in line and "rollout.group_size: 1" in line and f"trainer.algorithm: {algorithm}" in line


@pytest.mark.parametrize("algorithm", ["reinforce_pp", "ppo"])
def test_one_sample_groups_are_taken_where_the_baseline_is_not_the_group(algorithm):
    assert load_config(None, ["rollout.group_size=1", f"trainer.algorithm={algorithm}"]).rollout.group_size == 1

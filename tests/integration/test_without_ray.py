"""sluice without Ray (and without the optional heavy packages) on the local backend.

A GPU machine's image may hold torch and transformers but not Ray, matplotlib, datasets or
wandb (``scripts/gpu_check.sh``, docs/hardware.md). A child Python process is started with those
packages made absent (``tests/absent_modules/sitecustomize.py``, inherited by the processes it
spawns, such as the reward workers): ``import sluice``, the CLI and ``RLTrainer`` import, and
``sluice train run.backend=local`` trains one step in each mode and saves its final model.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"
ABSENT = ("ray", "vllm", "sglang", "datasets", "matplotlib", "wandb", "pandas", "math_verify")

CHILD = """
import importlib.util, json, sys
from pathlib import Path
absent = sys.argv[1].split(",")
found = [name for name in absent if importlib.util.find_spec(name) is not None]
try:
    import ray  # noqa: F401
    ray_importable = True
except ModuleNotFoundError:
    ray_importable = False
import sluice, sluice.cli, sluice.rl_trainer  # noqa: E401, F401
from tiny import save_tiny_task_model, tiny_run_overrides
model = save_tiny_task_model(Path(sys.argv[2]) / "model")
codes = {}
for mode in ("sync", "async"):
    run = [o for o in tiny_run_overrides(model, Path(sys.argv[2]), mode) if not o.startswith("run.steps=")]
    run += ["run.steps=1", "run.backend=local", f"run.mode={mode}", "run.eval_every=0", "rollout.group_size=2",
            "rollout.prompts_per_step=2", "rollout.max_new_tokens=8", "task.train_prompts=8", "tracking.plot=false"]
    codes[mode] = sluice.cli.main(["train", *run])
plotted = [o for o in run if o != "tracking.plot=false" and not o.startswith("run.name=")] + ["run.name=plot"]
codes["plot"] = sluice.cli.main(["train", *plotted])  # the default tracking.plot needs matplotlib
loaded = sorted(name for name in absent if sys.modules.get(name) is not None)
print(json.dumps({"found": found, "ray_importable": ray_importable, "codes": codes, "loaded": loaded}))
"""


def test_local_backend_trains_without_ray_and_optional_packages(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(map(str, (TESTS / "absent_modules", SRC, TESTS))),
        "SLUICE_ABSENT_MODULES": ",".join(ABSENT),
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD, ",".join(ABSENT), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["found"] == [], "the blocker did not hide these packages"
    assert report["ray_importable"] is False
    assert report["codes"]["sync"] == report["codes"]["async"] == 0
    assert report["codes"]["plot"] != 0 and "tracking.plot: matplotlib is not installed" in done.stderr
    assert not (tmp_path / "plot" / "metrics.jsonl").exists()  # said before training, not after
    assert report["loaded"] == []
    for mode in ("sync", "async"):
        records = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["kind"] == "train"] == [1], mode
        assert (tmp_path / mode / "final_model" / "config.json").is_file()

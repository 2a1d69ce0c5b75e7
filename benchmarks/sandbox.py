"""The code sandbox's cost per reward call: the old reward against the new, through the reward pool.

``old``: the response + tests as one program in the weaker ``unshare -rn`` mode, success = exit
code 0 (the reward before issue 17). ``new``: ``CodeExecReward`` as shipped (a bubblewrap
solution sandbox and a bubblewrap judge sandbox per call, each in its own cgroups). Each row
scores the same honest response ``--calls`` times through a ``RewardPool`` of 1 or 2 workers
and prints calls per second; the JSON goes to ``benchmarks/results/sandbox.json``.

    .venv/bin/python benchmarks/sandbox.py [--calls 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from harness.sandbox_run import run_sandboxed

from sluice.rewards.code_exec import CodeExecReward, extract_code
from sluice.rewards.pool import RewardPool
from sluice.rewards.sandbox import SandboxLimits

RESPONSE = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15"


@dataclass(frozen=True)
class ExitCodeReward:
    """The reward before issue 17: program + tests, 1.0 when it exits 0 (weak mode)."""

    def __call__(self, response: str, *, tests: str) -> float:
        program = f"{extract_code(response)}\n\n{tests}\n"
        return 1.0 if run_sandboxed(program, SandboxLimits(isolation="unshare")).status == "ok" else 0.0


async def rate(reward, workers: int, calls: int) -> float:
    pool = RewardPool(workers, "forkserver")
    try:
        await asyncio.gather(*(pool.call(reward, RESPONSE, {"tests": TESTS}, 60) for _ in range(workers)))  # warm
        started = time.perf_counter()
        values = await asyncio.gather(*(pool.call(reward, RESPONSE, {"tests": TESTS}, 60) for _ in range(calls)))
        elapsed = time.perf_counter() - started
    finally:
        pool.close()
    assert values == [1.0] * calls, values
    return calls / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    rows = []
    for workers in (1, 2):
        for name, reward in (("old", ExitCodeReward()), ("new", CodeExecReward())):
            per_s = asyncio.run(rate(reward, workers, args.calls))
            rows.append({"reward": name, "workers": workers, "calls_per_s": per_s})
    print(f"{'reward':<8}{'workers':>8}{'calls/s':>10}{'ms/call':>10}   ({os.cpu_count()} CPUs)")
    for row in rows:
        print(f"{row['reward']:<8}{row['workers']:>8}{row['calls_per_s']:>10.2f}{1000 / row['calls_per_s']:>10.0f}")
    out = Path(__file__).parent / "results" / "sandbox.json"
    out.write_text(json.dumps({"calls": args.calls, "cpus": os.cpu_count(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

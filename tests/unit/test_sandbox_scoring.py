"""``CodeExecReward``: honest programs score, and nothing a program does can fake a pass."""

import asyncio

import pytest
from harness.sandbox_run import run_sandboxed

from sluice.rewards import CodeExecReward
from sluice.rewards.code_exec import plan_tests
from sluice.rewards.code_wire import decode, encode
from sluice.rewards.jail import bwrap_problem
from sluice.rewards.sandbox import SandboxLimits

pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap sandbox: {bwrap_problem()}")

LIMITS = SandboxLimits(cpu_s=2, wall_s=8)
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15"
GOOD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```"

HACKS = {
    "exit before the tests": "def add(a, b):\n    return -7\nraise SystemExit(0)",
    "os._exit before the tests": "import os\ndef add(a, b):\n    return -7\nos._exit(0)",
    "exit inside the call": "import sys\ndef add(a, b):\n    sys.exit(0)",
    "os._exit inside the call": "import os\ndef add(a, b):\n    os._exit(0)",
    "AssertionError replaced": "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
    "def add(a, b):\n    return -7",
    "builtins patched": "import builtins\nbuiltins.len = lambda x: 3\nbuiltins.print = lambda *a: None\n"
    "builtins.__import__ = None\ndef add(a, b):\n    return -7",
    "excepthook swallows the failure": "import sys\nsys.excepthook = lambda *a: None\ndef add(a, b):\n    return -7",
    "always-equal result": "class Yes:\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = object.__hash__\ndef add(a, b):\n    return Yes()",
    "int subclass equal to all": "class Yes(int):\n    def __eq__(self, other):\n        return True\n"
    "def add(a, b):\n    return Yes(-7)",
    "shadowing a builtin the tests use": "def abs(x):\n    return 5\ndef add(a, b):\n    return -7",
    "forged report on every descriptor": "import os\nfor fd in range(3, 64):\n    try:\n"
    "        os.write(fd, b'pass 0\\npass 1\\npass 2\\n')\n    except OSError:\n        pass\n"
    "print('pass 0\\npass 1\\npass 2')\ndef add(a, b):\n    return -7",
    "tampering with the harness's own module": "import sys\nwire = sys.modules['code_wire']\n"
    "wire.decode = lambda data, on_ref: 5\ndef add(a, b):\n    return -7",
}


def test_an_honest_correct_program_scores_one_and_a_wrong_one_zero():
    reward = CodeExecReward(LIMITS)
    assert reward(GOOD, tests=TESTS) == 1.0
    assert reward("```python\ndef add(a, b):\n    return a - b\n```", tests=TESTS) == 0.0
    assert reward("def add(a, b): return a + b", tests=TESTS) == 1.0  # no fence: the whole response
    assert reward("def add(a, b):\n    while True:\n        pass", tests=TESTS) == 0.0


def test_partial_credit_by_default_all_or_nothing_by_option():
    half = "def add(a, b):\n    return a + b if a > 0 else 99"  # passes tests 1 and 3
    assert CodeExecReward(LIMITS)(half, tests=TESTS) == pytest.approx(2 / 3)
    assert CodeExecReward(LIMITS, scoring="all")(half, tests=TESTS) == 0.0
    assert CodeExecReward(LIMITS, scoring="all")(GOOD, tests=TESTS) == 1.0


@pytest.mark.parametrize("name", sorted(HACKS))
def test_reward_hacks_score_zero(name):
    tests = TESTS + ("\nassert abs(add(2, 2)) == 5" if "abs" in name else "")
    score = CodeExecReward(LIMITS).score(HACKS[name], tests)
    assert score.passed == 0, (name, score.judge.stderr)


def test_the_old_exit_code_scoring_was_fooled_by_an_early_exit():
    """The control: program + tests judged by exit code (the old reward) passes the hack."""
    assert run_sandboxed(HACKS["exit before the tests"] + "\n" + TESTS, LIMITS).status == "ok"
    assert run_sandboxed(HACKS["os._exit before the tests"] + "\n" + TESTS, LIMITS).status == "ok"


def test_objects_iterators_exceptions_and_in_place_changes_cross_the_wire():
    code = (
        "from collections import Counter, namedtuple\n"
        "Point = namedtuple('Point', 'x y')\n"
        "class Stack:\n"
        "    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n"
        "    def pop(self):\n        return self.items.pop()\n"
        "    def __len__(self):\n        return len(self.items)\n"
        "def squares(n):\n    yield from (i * i for i in range(n))\n"
        "def sort_in_place(xs):\n    xs.sort()\n"
        "def check(x):\n    if x < 0:\n        raise ValueError('negative')\n    return Counter('aab')\n"
        "def origin():\n    return Point(0, 0)\n"
    )
    tests = (
        "s = Stack()\ns.push(1)\ns.push(2)\n"
        "assert len(s) == 2 and s.pop() == 2\n"
        "assert list(squares(4)) == [0, 1, 4, 9]\n"
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]\n"
        "assert check(1) == {'a': 2, 'b': 1}\n"
        "try:\n    check(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\nelse:\n    assert False\n"
        "assert origin() == (0, 0) and origin().x == 0\n"
        "def test_float():\n    assert 0.1 + 0.2 != 0.3\n"
    )
    score = CodeExecReward(LIMITS).score(code, tests)
    assert (score.passed, score.total) == (7, 7), score.judge.stderr


def test_a_check_script_without_asserts_is_one_test():
    check = "def check(candidate):\n    assert candidate(1, 1) == 2\n\ncheck(add)"
    assert plan_tests(check) == [{"kind": "test", "source": check, "line": 1}]
    assert CodeExecReward(LIMITS)(GOOD, tests=check) == 1.0
    assert CodeExecReward(LIMITS)("def add(a, b): return 0", tests=check) == 0.0


def test_bad_input_is_one_clear_line():
    reward = CodeExecReward(LIMITS)
    with pytest.raises(ValueError, match=r"^code_exec: the row's 'tests' is not valid Python \(line 1: "):
        reward(GOOD, tests="assert add(1,")
    with pytest.raises(TypeError, match=r"^code_exec: the row's 'tests' must be a string of Python, got list$"):
        reward(GOOD, tests=["assert True"])
    with pytest.raises(ValueError, match=r"^code_exec: the row's 'tests' holds no statement to run$"):
        reward(GOOD, tests="# nothing")
    with pytest.raises(ValueError, match=r"^code_exec: scoring must be 'fraction' or 'all', got 'most'$"):
        CodeExecReward(LIMITS, scoring="most")(GOOD, tests=TESTS)  # type: ignore[arg-type]


def test_the_wire_rebuilds_genuine_values_only():
    class Sneaky(int):
        def __eq__(self, other):
            return True

    refs = []
    data = encode([1, (2.5, float("inf")), {"k": {3}}, Sneaky(4)], lambda v: refs.append(v) or {"t": "ref", "id": 1})
    assert refs and isinstance(refs[0], Sneaky)  # a subclass is never sent as a value
    back = decode(data, lambda ref: "REF")
    assert back == [1, (2.5, float("inf")), {"k": {3}}, "REF"]
    with pytest.raises(ValueError, match="unknown tag on the wire: 'code'"):
        decode({"t": "code", "v": "print(1)"}, lambda ref: None)


def test_code_exec_runs_from_the_reward_pool():
    from sluice.config import RewardConfig
    from sluice.rewards import build_reward_service

    service = build_reward_service(RewardConfig(name="code_exec", pool_size=1), default=lambda r: 0.0)
    try:
        value = asyncio.run(service("```python\ndef f():\n    return 1\n```", tests="assert f() == 1"))
    finally:
        service.close()
    assert value == 1.0 and service.stats()["reward_calls"] == 1

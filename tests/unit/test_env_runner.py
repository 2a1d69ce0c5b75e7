"""EnvRunner: environment-level async rollout (no barrier), the lockstep baseline, redundant
environments completing groups despite fail-stop envs, and env timeouts / crashes counted."""

from __future__ import annotations

import asyncio

import pytest

from fakes import FakeEnv, FakeInferenceEngine
from sluice.api import PromptItem, SamplingParams
from sluice.queue import AsyncLocalQueue, LocalQueue
from sluice.queue.samples import SAMPLE_COLUMNS, rows_to_samples
from sluice.rollout.env_runner import ENV_FAILURE, EnvRunner
from sluice.rollout.episode import EpisodeLimits, EpisodeRunner
from sluice.rollout.trajectory import ChatFormat
from sluice.sim import run_virtual
from sluice.sim.task import SimTokenizer


class EnvFactory:
    """Numbered ``FakeEnv`` s; ``make(n)`` gives instance ``n``'s keyword arguments."""

    def __init__(self, make=lambda n: {}) -> None:
        self.make = make
        self.envs: list[FakeEnv] = []

    def __call__(self) -> FakeEnv:
        env = FakeEnv(**{"turns": 3, **self.make(len(self.envs))})
        self.envs.append(env)
        return env


def _runner(factory, *, group_size=2, redundancy=0, mode="async", step_timeout_s=None, step_latency_s=0.0):
    tok = SimTokenizer()
    queue = LocalQueue()
    queue.register_task("train", SAMPLE_COLUMNS)
    episodes = EpisodeRunner(
        FakeInferenceEngine(vocab=50),
        factory,
        encode_prompt=tok.encode,
        encode=lambda text: tok.encode(text),
        decode=tok.decode,
        chat=ChatFormat(turn_end="."),
        params=SamplingParams(4),
        limits=EpisodeLimits(
            max_turns=8, max_context=1000, turn_tokens=4, step_timeout_s=step_timeout_s, step_latency_s=step_latency_s
        ),
    )
    runner = EnvRunner(episodes, AsyncLocalQueue(queue), group_size=group_size, group_redundancy=redundancy, mode=mode)
    return runner, queue


async def _wave(runner, groups):
    items = [(PromptItem(gid, "", (), {}), gid) for gid in groups]
    return [report async for report in runner.run_groups(items)]


def _delay(n: int):
    return lambda step: float((n * 7 + step * 3) % 5 + 1)


def _step_times(env: FakeEnv) -> list[float]:
    return [t for event, t in env.log if event == "step"]


def test_env_level_async_never_waits_on_a_barrier():
    factory = EnvFactory(lambda n: {"delay_s": _delay(n)})
    runner, _ = _runner(factory)
    reports = run_virtual(_wave(runner, [0, 1, 2]))
    assert all(r.discard_reason is None for r in reports)
    for n, env in enumerate(factory.envs):
        # each env's step k starts exactly when its own previous steps are done: nobody else's
        own = [sum(_delay(n)(j) for j in range(k)) for k in range(env.turns)]
        assert _step_times(env) == pytest.approx(own)
    assert runner.counts["barrier_waits"] == 0


def test_barrier_mode_moves_episodes_in_lockstep_and_is_slower():
    async def timed(mode):
        factory = EnvFactory(lambda n: {"delay_s": _delay(n)})
        runner, _ = _runner(factory, mode=mode)
        await _wave(runner, [0, 1, 2])
        return asyncio.get_running_loop().time(), factory, runner

    async_s, _, _ = run_virtual(timed("async"))
    barrier_s, factory, runner = run_virtual(timed("barrier"))
    per_turn = [max(_delay(n)(k) for n in range(6)) for k in range(3)]
    for env in factory.envs:  # step k of every env starts when the slowest step k - 1 ended
        assert _step_times(env) == pytest.approx([sum(per_turn[:k]) for k in range(3)])
    assert barrier_s == pytest.approx(sum(per_turn))
    assert async_s == pytest.approx(max(sum(_delay(n)(k) for k in range(3)) for n in range(6)))
    assert async_s < barrier_s and runner.counts["barrier_waits"] > 0


def test_redundant_episodes_complete_a_group_despite_fail_stop_envs():
    hung = {0, 3}  # two of the group's four envs never answer their first step (no timeout set)
    factory = EnvFactory(lambda n: {"fail": (0, "hang")} if n in hung else {"delay_s": _delay(n)})
    runner, queue = _runner(factory, group_size=2, redundancy=2)
    (report,) = run_virtual(_wave(runner, [4]))
    assert report.discard_reason is None and len(report.rewards) == 2
    assert runner.counts["episodes_kept"] == 2
    assert runner.counts["episodes_aborted_straggler"] == 2
    assert all(env.closed for env in factory.envs)  # aborted stragglers are closed too
    batch = queue.get("train", SAMPLE_COLUMNS, batch_size=2, timeout=1.0)
    assert sorted(batch.indices) == [8, 9]
    assert {s.uid for s in rows_to_samples(batch)} == {"4-1", "4-2"}


def test_timeouts_and_raising_envs_are_counted_and_do_not_crash():
    failing = {0: {"fail": (1, "hang")}, 1: {"fail": (0, "raise")}}
    factory = EnvFactory(lambda n: failing.get(n, {"delay_s": lambda step: 20.0}))  # healthy: 60 s
    runner, _ = _runner(factory, group_size=2, redundancy=2, step_timeout_s=30.0)
    (report,) = run_virtual(_wave(runner, [0]))
    assert report.discard_reason is None
    assert runner.counts["episodes_env_timeout"] == 1 and runner.counts["episodes_env_error"] == 1
    assert runner.counts["episodes_kept"] == 2


def test_group_that_cannot_complete_is_discarded_and_its_rows_cleared():
    # envs 0 and 2 finish (1.5 s, their rows are written), 1 and 3 crash later (at 2 s): with
    # group_size 3 the group cannot complete
    slow = {"delay_s": lambda step: 1.0, "fail": (2, "raise")}
    factory = EnvFactory(lambda n: slow if n % 2 else {"delay_s": lambda step: 0.5})
    runner, queue = _runner(factory, group_size=3, redundancy=1)
    (report,) = run_virtual(_wave(runner, [2]))
    assert report.discard_reason == ENV_FAILURE
    assert runner.counts["episodes_env_error"] == 2
    assert queue.stats()["rows"] == 0  # the two rows written were cleared with the group


def test_abort_groups_reports_the_reason_and_stops_episodes():
    factory = EnvFactory(lambda n: {"delay_s": lambda step: 100.0})
    runner, _ = _runner(factory, group_size=2)

    async def run():
        wave = asyncio.ensure_future(_wave(runner, [0, 1]))
        await asyncio.sleep(50.0)
        runner.abort_groups([1], "redundant")
        return await wave, asyncio.get_running_loop().time()

    reports, elapsed = run_virtual(run())
    by_group = {r.group_id: r for r in reports}
    assert by_group[1].discard_reason == "redundant" and by_group[0].discard_reason is None
    assert runner.counts["episodes_cancelled"] == 2
    assert elapsed == pytest.approx(300.0)


def test_held_out_evaluation_plays_one_greedy_episode_per_row():
    from sluice.rollout.agentic import evaluate_episodes

    factory = EnvFactory(lambda n: {"fail": (0, "raise")} if n == 3 else {})
    runner, _ = _runner(factory)
    items = [PromptItem(i, "", (), {}) for i in range(6)]
    result = run_virtual(evaluate_episodes(runner.episodes, items))
    engine = runner.episodes.engine
    assert {r.params.temperature for r in engine.requests} == {0.0}
    assert len(factory.envs) == 6 and all(env.closed for env in factory.envs)
    wins = [float(bool(env.actions[0])) for n, env in enumerate(factory.envs) if n != 3]  # env 3 crashed: a miss
    assert result.count == 6 and 0 < result.accuracy == pytest.approx(sum(wins) / 6)


def test_a_tool_env_shows_its_tools_in_the_first_prompt_and_its_group_reaches_the_queue():
    """Against ``FakeToolEnv`` and ``FakeAsyncQueueClient``: the episode's first prompt carries the
    env's tool schema (plain envs show none), and the finished group's rows are written once."""
    from fakes import FakeAsyncQueueClient, FakeToolEnv

    tok = SimTokenizer()
    engine = FakeInferenceEngine(vocab=50)
    queue = FakeAsyncQueueClient()
    episodes = EpisodeRunner(
        engine,
        lambda: FakeToolEnv(turns=2),
        encode_prompt=tok.encode,
        encode=lambda text: tok.encode(text),
        decode=tok.decode,
        chat=ChatFormat(first="{tools}|{observation}", turn_end="."),
        params=SamplingParams(4),
        limits=EpisodeLimits(max_turns=4, max_context=1000, turn_tokens=4),
    )
    runner = EnvRunner(episodes, queue, group_size=2)
    reports = run_virtual(_wave(runner, [7]))
    assert [r.discard_reason for r in reports] == [None]
    first = "".join(chr(i) for i in engine.requests[0].prompt_ids)  # SimTokenizer: one id per character
    assert "echo" in first and first.endswith("|start")
    assert sorted(queue.sync.rows) == [14, 15] and all(set(SAMPLE_COLUMNS) <= set(r) for r in queue.sync.rows.values())


def test_sampled_held_out_episodes_give_mean_and_pass_at_k():
    from sluice.config.data import EvalConfig
    from sluice.rollout.agentic import evaluate_episodes

    # env n is the n-th episode started: greedy rows 0-3, then row i's samples 4 + 2i, 5 + 2i;
    # crashed episodes are misses: greedy row 1, both samples of row 0, the first of row 1
    factory = EnvFactory(lambda n: {"fail": (0, "raise")} if n in (1, 4, 5, 6) else {})
    runner, _ = _runner(factory)
    items = [PromptItem(i, "", (), {}) for i in range(4)]
    result = run_virtual(evaluate_episodes(runner.episodes, items, EvalConfig(samples=2, temperature=0.5)))
    engine = runner.episodes.engine
    assert {r.params.temperature for r in engine.requests} == {0.0, 0.5}
    assert len(factory.envs) == 4 + 4 * 2
    assert (result.samples, result.accuracy) == (2, 0.75)
    assert (result.mean_at_k, result.pass_at_k) == (5 / 8, 0.75)
    assert result.by_source["default"].count == 4


def test_env_latency_waits_before_each_step_with_a_drawn_gaussian_wait():
    """``agentic.env_latency_s``: each step answers after a wait of mean and deviation μ, clipped
    at 0, drawn from the episode's own seed (sync and async runs see the same waits)."""
    from sluice.rollout.episode import waiting_latency
    from sluice.rollout.single_turn import sample_seed

    factory = EnvFactory()
    runner, _ = _runner(factory, group_size=2, step_latency_s=2.0)
    reports = run_virtual(_wave(runner, [5]))
    assert reports[0].discard_reason is None
    waits = []
    for k, env in enumerate(factory.envs):  # the group's episodes, in order
        drawn = [waiting_latency(2.0, sample_seed(0, 5, k * 1009 + turn) + 1) for turn in range(env.turns)]
        assert _step_times(env) == pytest.approx([sum(drawn[: t + 1]) for t in range(env.turns)])
        waits += drawn
    assert len(set(waits)) == len(waits) and min(waits) >= 0.0


def test_waiting_latency_is_a_gaussian_of_mean_and_deviation_mu_clipped_at_zero():
    import statistics

    from sluice.rollout.episode import waiting_latency

    draws = [waiting_latency(1.0, seed) for seed in range(4000)]
    clipped = sum(d == 0.0 for d in draws) / len(draws)
    assert min(draws) == 0.0 and 0.12 < clipped < 0.20  # P(N(1, 1) < 0) = 0.159
    assert 1.0 < statistics.mean(draws) < 1.2  # clipping raises the mean a little (1.083)
    assert waiting_latency(0.0, 1) == 0.0 and waiting_latency(1.0, 7) == waiting_latency(1.0, 7)


class SlowAckQueue(AsyncLocalQueue):
    """Stores a write at once and acknowledges it ``ack_s`` later (a remote store's round trip);
    counts the queue calls."""

    def __init__(self, queue, ack_s: float) -> None:
        super().__init__(queue)
        self.ack_s, self.calls = ack_s, 0

    async def put(self, *args, **kwargs):
        self.calls += 1
        await super().put(*args, **kwargs)
        await asyncio.sleep(self.ack_s)


def _slow_ack_runner(factory, group_size, ack_s):
    runner, queue = _runner(factory, group_size=group_size)
    slow = SlowAckQueue(queue, ack_s)
    runner.queue = slow
    if hasattr(runner, "writer"):
        runner.writer.queue = slow
    return runner, queue, slow


def test_episodes_ending_together_share_one_queue_write():
    factory = EnvFactory(lambda n: {"delay_s": lambda step: 1.0})  # every episode ends at the same instant
    runner, queue, slow = _slow_ack_runner(factory, group_size=4, ack_s=0.5)
    (report,) = run_virtual(_wave(runner, [0]))
    assert report.discard_reason is None and queue.stats()["rows"] == 4
    assert slow.calls == 1 and runner.stats()["env_queue_puts"] == 4.0 and runner.stats()["env_queue_writes"] == 1.0


def test_a_group_aborted_while_its_rows_are_being_written_leaves_none():
    """The first episode's row is stored but not yet acknowledged when the group is aborted: it is
    cleared with the group, not left in the queue."""
    factory = EnvFactory(lambda n: {"delay_s": (lambda step: 0.5) if n == 0 else (lambda step: 100.0)})
    runner, queue, slow = _slow_ack_runner(factory, group_size=2, ack_s=10.0)

    async def run():
        wave = asyncio.ensure_future(_wave(runner, [0]))
        await asyncio.sleep(3.0)  # episode 0 ended at 1.5 s; its write is acknowledged at 11.5 s
        assert queue.stats()["rows"] == 1
        runner.abort_groups([0], "redundant")
        return await wave

    (report,) = run_virtual(run())
    assert report.discard_reason == "redundant" and slow.calls == 1
    assert queue.stats()["rows"] == 0 and runner.counts["episodes_group_aborted"] == 1


def test_an_env_sees_a_turn_as_the_agent_endpoint_hands_it_to_an_agent():
    """A sampled special token inside a turn stays in the env's action (as the agent endpoint keeps
    it, ``AgentSession.decode``), and only the closing turn-end token is left out: an env that
    dropped ``<unk>`` would compute ``9*55`` where the agent's tool answers ``err``, and the two
    paths' token streams part (``test_calculator_agent.py`` on a short warm start)."""
    from sluice.rollout.agentic import action_text
    from sluice.tasks.tiny_model import build_char_tokenizer

    tok = build_char_tokenizer("0123456789*c")
    stop = (tok.eos_token_id,)
    ids = [*tok.encode("c9*", add_special_tokens=False), tok.unk_token_id, *tok.encode("55", add_special_tokens=False)]
    assert action_text(tok, [*ids, tok.eos_token_id], stop) == "c9*<unk>55"
    assert action_text(tok, ids, stop) == "c9*<unk>55"  # a turn cut by the token cap has no turn end

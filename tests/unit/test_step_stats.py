"""A step's logged rollout statistics, from its groups' reports: the numbers a verl user looks for
(reward mean / std / min / max, per data source, response length mean / max, share cut at the cap)."""

from types import SimpleNamespace

import pytest

from sluice.api import GroupReport
from sluice.controller.training import step_stats


def _report(gid, rewards, lengths, truncated, source):
    return GroupReport(
        gid, 0, len(rewards), sum(lengths), tuple(rewards), response_lengths=tuple(lengths),
        truncated=truncated, data_source=source, sample_versions=(0,) * len(rewards),
    )  # fmt: skip


def test_the_step_reports_reward_spread_lengths_the_cap_share_and_each_source():
    reports = {0: _report(0, [1.0, 0.0], [3, 8], 1, "math"), 1: _report(1, [1.0, 1.0], [2, 4], 0, "code")}
    controller = SimpleNamespace(reports=reports, pipeline=SimpleNamespace(engine_version=1), sync_metrics={})
    stats = step_stats(controller, [0, 1], 1, {})
    assert stats["reward_mean"] == pytest.approx(0.75)
    assert stats["reward_std"] == pytest.approx(0.1875**0.5)  # rewards 1, 0, 1, 1 around 0.75
    assert (stats["reward_min"], stats["reward_max"]) == (0.0, 1.0)
    assert stats["reward_mean/math"] == pytest.approx(0.5) and stats["reward_mean/code"] == pytest.approx(1.0)
    assert stats["response_len_mean"] == pytest.approx(17 / 4) and stats["response_len_max"] == 8.0
    assert stats["response_clip_ratio"] == pytest.approx(0.25)
    one_source = {0: _report(0, [1.0, 0.0], [3, 8], 0, "math")}
    controller.reports = one_source
    assert not [k for k in step_stats(controller, [0], 1, {}) if k.startswith("reward_mean/")]  # one source: no split

"""SGLangEngine against a loopback server speaking SGLang 0.5.23's routes (``FakeSGLangServer``).

The client, the segmenting and the weight-update modes are the real code; the server's 'model'
is scripted so that each token shows which weights produced it. ``test_sglang_api.py`` checks
the routes and fields of both client and fake against the real wheel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fake_sglang import FakeSGLangServer
from sluice.api import Completion, GenerationRequest, SamplingParams, VersionedEngine
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm
from sluice.engines.sglang_engine import SGLangEngine, SGLangError, SGLangHTTP
from tiny import save_tiny_task_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_task_model(tmp_path_factory.mktemp("sglang_model"))


@pytest.fixture
def server(model_dir: Path) -> Iterator[FakeSGLangServer]:
    server = FakeSGLangServer(model_dir)
    yield server
    server.close()


@pytest.fixture(scope="module")
def new_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    weights = {name: w.clone() for name, w in load_causal_lm(model_dir).state_dict().items()}
    weights["model.norm.weight"] += 0.5  # any change of the sum changes the fake's outputs
    return weights


def _req(rid: str, n: int, prompt: tuple[int, ...] = (1, 5), **params: object) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_new_tokens=n, **params), seed=7)  # type: ignore[arg-type]


def _engine(model_dir: Path, server: FakeSGLangServer, tmp_path: Path) -> SGLangEngine:
    return SGLangEngine(model_dir, url=server.url, weights_dir=tmp_path)


def _check_tokens(server: FakeSGLangServer, c: Completion, shifts: dict[int, int]) -> None:
    """Each token continues its prefix with the shift of the weights its version names."""
    prefix = list(c.prompt_ids)
    for token, logprob, version in zip(c.token_ids, c.logprobs, c.versions, strict=True):
        assert token == (prefix[-1] + shifts[version]) % server.vocab
        assert logprob == pytest.approx(server.expected_logprob(shifts[version], len(prefix)))
        prefix.append(token)


def test_generate_sends_sglang_payloads_and_reads_tokens(model_dir: Path, server, tmp_path: Path) -> None:
    async def main() -> list[Completion]:
        engine = _engine(model_dir, server, tmp_path)
        assert isinstance(engine, VersionedEngine)
        stop = (5 + 2 * server.shift) % server.vocab  # the second token after prompt (1, 5)
        return await asyncio.gather(engine.generate(_req("a", 6, temperature=0.5)),
                                    engine.generate(_req("b", 6, stop_token_ids=(stop,))))  # fmt: skip

    a, b = asyncio.run(main())
    assert len(a.token_ids) == 6 and a.finish_reason == "length" and set(a.versions) == {0}
    assert len(b.token_ids) == 2 and b.finish_reason == "stop"
    _check_tokens(server, a, {0: server.shift})
    body = next(x for x in server.bodies["/generate"] if x["rid"] == "a")
    assert body["input_ids"] == [1, 5] and body["return_logprob"] is True
    assert body["sampling_params"]["max_new_tokens"] == 6 and body["sampling_params"]["temperature"] == 0.5
    assert body["sampling_params"]["ignore_eos"] is True


def test_abort_stops_one_request_on_the_server(model_dir: Path, server, tmp_path: Path) -> None:
    async def main() -> list[Completion]:
        engine = _engine(model_dir, server, tmp_path)
        tasks = [asyncio.ensure_future(engine.generate(_req(rid, 60))) for rid in ("x", "y")]
        while engine.stats()["running"] < 2:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)
        engine.abort("x")
        return await asyncio.gather(*tasks)

    x, y = asyncio.run(main())
    assert x.finish_reason == "abort" and 0 < len(x.token_ids) < 60
    assert y.finish_reason == "length" and len(y.token_ids) == 60
    assert [b["rid"] for b in server.bodies["/abort_request"]] == ["x"]


def test_interrupt_update_resubmits_and_versions_each_token(model_dir: Path, server, tmp_path, new_weights) -> None:
    old_shift = server.shift

    async def main() -> tuple[list[Completion], SGLangEngine]:
        engine = _engine(model_dir, server, tmp_path)
        tasks = [asyncio.ensure_future(engine.generate(_req(f"i{k}", 80, prompt=(k + 1,)))) for k in range(3)]
        while engine.stats()["running"] < 3:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.03)
        engine.update_weights(new_weights, 1, "interrupt")
        return await asyncio.gather(*tasks), engine

    done, engine = asyncio.run(main())
    assert server.shift != old_shift and engine.version == 1
    model = load_causal_lm(model_dir)
    model.load_state_dict(new_weights)
    assert engine.weights_checksum() == pytest.approx(HFInferenceEngine(model).weights_checksum(), rel=1e-12)
    for c in done:
        assert len(c.token_ids) == 80 and c.finish_reason == "length"
        assert set(c.versions) == {0, 1} and list(c.versions) == sorted(c.versions)
        _check_tokens(server, c, {0: old_shift, 1: server.shift})
    resumed = [b for b in server.bodies["/generate"] if "#" in b["rid"]]
    assert len(resumed) == 3 and engine.stats()["reprefill_tokens"] == sum(len(b["input_ids"]) for b in resumed)
    update = server.bodies["/update_weights_from_disk"]
    assert len(update) == 1 and update[0]["weight_version"] == "1" and engine.stats()["weight_updates"] == 1


def test_defer_update_drains_before_loading(model_dir: Path, server, tmp_path: Path, new_weights) -> None:
    old_shift = server.shift

    async def main() -> tuple[Completion, Completion, dict[str, float]]:
        engine = _engine(model_dir, server, tmp_path)
        running = asyncio.ensure_future(engine.generate(_req("r", 40)))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.005)
        engine.update_weights(new_weights, 1, "defer")
        staged = engine.stats()
        later = asyncio.ensure_future(engine.generate(_req("later", 5)))
        return await running, await later, staged

    ran, later, staged = asyncio.run(main())
    assert staged["pending_version"] == 1 and staged["version"] == 0
    assert set(ran.versions) == {0} and len(ran.token_ids) == 40
    _check_tokens(server, ran, {0: old_shift})
    assert set(later.versions) == {1}
    _check_tokens(server, later, {1: server.shift})
    assert not server.bodies["/abort_request"]


def test_pause_and_resume_reach_the_server(model_dir: Path, server, tmp_path: Path) -> None:
    async def main() -> Completion:
        engine = _engine(model_dir, server, tmp_path)
        task = asyncio.ensure_future(engine.generate(_req("p", 200)))
        engine.pause()
        while server.resumed.is_set():
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        assert not task.done()
        engine.resume()
        return await task

    done = asyncio.run(main())
    assert len(done.token_ids) == 200
    assert (
        server.bodies["/pause_generation"] == [{"mode": "in_place"}] and len(server.bodies["/continue_generation"]) == 1
    )


def test_server_errors_name_the_route(server) -> None:
    with pytest.raises(SGLangError, match="HTTP 404"):
        asyncio.run(SGLangHTTP(server.url).post("/no_such_route", {}))
    with pytest.raises(ValueError, match=r"sglang\.url"):
        SGLangHTTP("localhost:30000")

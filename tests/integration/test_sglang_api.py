"""The SGLang routes and fields that ``SGLangEngine`` and ``FakeSGLangServer`` use exist in the
pinned SGLang wheel, so the fake breaks when the real API moves.

The wheel (39 MB, CUDA-only, never installed) is fetched once with ``pip download --no-deps``
into ``.cache/sglang-wheel`` and read as a zip archive; the test skips with a message when the
package index cannot be reached.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fake_sglang import FakeSGLangServer
from sluice.api import GenerationRequest, SamplingParams
from sluice.engines.segmented import Segment
from sluice.engines.sglang_engine import ROUTES, SGLANG_VERSION, generate_payload, update_payload

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "sglang-wheel"


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(CACHE),
               f"sglang=={SGLANG_VERSION}"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if done.returncode != 0 or not found:
            pytest.skip(f"cannot download sglang=={SGLANG_VERSION} (offline?): {done.stderr.strip()[-300:]}")
    return zipfile.ZipFile(found[0])


def _source(wheel: zipfile.ZipFile, path: str) -> str:
    return wheel.read(f"sglang/srt/{path}").decode()


def _post_routes(server_source: str) -> set[str]:
    """Paths of ``@app.post(...)`` and POST ``@app.api_route(...)`` handlers."""
    routes = set(re.findall(r'@app\.post\(\s*"([^"]+)"', server_source))
    for path, methods in re.findall(r'@app\.api_route\(\s*"([^"]+)",\s*methods=\[([^\]]*)\]', server_source):
        if '"POST"' in methods:
            routes.add(path)
    return routes


def _fields(module_source: str, name: str) -> set[str]:
    """Annotated fields of class ``name`` and of its bases defined in the same module."""
    classes = {n.name: n for n in ast.parse(module_source).body if isinstance(n, ast.ClassDef)}
    node = classes[name]
    own = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    bases = {b.id for b in node.bases if isinstance(b, ast.Name) and b.id in classes}
    return own.union(*(_fields(module_source, b) for b in bases))


def test_client_and_fake_routes_exist_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    routes = _post_routes(_source(wheel, "entrypoints/http_server.py"))
    assert set(ROUTES.values()) <= routes
    assert set(FakeSGLangServer.ROUTES) == set(ROUTES.values())


def test_payload_fields_exist_in_the_request_classes(wheel: zipfile.ZipFile) -> None:
    io_struct = _source(wheel, "managers/io_struct.py")
    sampling = _fields(_source(wheel, "sampling/sampling_params.py"), "SamplingParams")
    request_class = {
        "/generate": "GenerateReqInput",
        "/abort_request": "AbortReq",
        "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
        "/pause_generation": "PauseGenerationReqInput",
        "/continue_generation": "ContinueGenerationReqInput",
    }
    for route, cls in request_class.items():
        assert FakeSGLangServer.FIELDS[route] <= _fields(io_struct, cls), route
    assert FakeSGLangServer.FIELDS["sampling_params"] <= sampling
    request = GenerationRequest("r", (1, 2), SamplingParams(8, stop_token_ids=(3,)))
    sent = generate_payload(Segment("r", (1, 2), request, 8, 5))
    assert set(sent) <= FakeSGLangServer.FIELDS["/generate"]
    assert set(sent["sampling_params"]) <= FakeSGLangServer.FIELDS["sampling_params"]
    assert set(update_payload(Path("/dev/shm/x"), 1)) <= FakeSGLangServer.FIELDS["/update_weights_from_disk"]


def test_response_keys_the_client_reads_are_produced(wheel: zipfile.ZipFile) -> None:
    manager = _source(wheel, "managers/tokenizer_manager.py")
    for key in ('"output_ids"', '"meta_info"', '"finish_reason"', "output_token_logprobs"):
        assert key in manager, key
    finish_reasons = _source(wheel, "managers/schedule_batch.py")  # the meta_info.finish_reason types
    for kind in ("stop", "length", "abort"):
        assert f'"type": "{kind}"' in finish_reasons, kind

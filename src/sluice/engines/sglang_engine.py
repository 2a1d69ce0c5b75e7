"""``SGLangEngine``: the ``InferenceEngine`` Protocol over a running SGLang server's HTTP API.

Pinned to SGLang 0.5.23's native routes: ``POST /generate`` with ``input_ids``,
``sampling_params`` and ``return_logprob`` (the response's ``output_ids`` and
``meta_info.output_token_logprobs`` / ``meta_info.finish_reason``), ``POST /abort_request``
(``rid``), ``POST /update_weights_from_disk`` (``model_path``), and ``/pause_generation`` /
``/continue_generation``. A test reads these names from that version's wheel, so an API change
breaks the build instead of a run. Versions and weight-update modes are ``SegmentedEngine``'s;
an update is a folder under ``sglang.weights_dir``, which the server must be able to read.
Weights stay folder-based here (vLLM takes them in memory, ``vllm_engine.py``) until the
engine can be tested against a real SGLang server: its tensor routes are not used.

SGLang reports log-probs of the temperature-scaled distribution (before top-p), the
``Completion.logprobs`` convention. The server's own EOS handling is switched off
(``ignore_eos``) so a request stops only on its ``stop_token_ids``. The HTTP client is a few
lines over ``asyncio`` streams (one connection per call, JSON bodies), so sluice needs no HTTP
library. Not here: starting the server (``python -m sglang.launch_server``; SGLang has no CPU
wheel on PyPI), streaming responses, multi-modal inputs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sluice.engines.segmented import Delta, Segment, SegmentedEngine
from sluice.engines.weight_folder import DEFAULT_ROOT, WeightFolders

SGLANG_VERSION = "0.5.23"
"""The SGLang release whose HTTP API this adapter speaks."""

ROUTES = {
    "generate": "/generate",
    "abort": "/abort_request",
    "update_weights": "/update_weights_from_disk",
    "pause": "/pause_generation",
    "resume": "/continue_generation",
}


class SGLangError(RuntimeError):
    """The SGLang server answered a call with an error status."""


def generate_payload(segment: Segment) -> dict[str, Any]:
    """The ``/generate`` body for one segment (keys are ``GenerateReqInput`` / ``SamplingParams`` fields)."""
    p = segment.request.params
    return {
        "rid": segment.segment_id,
        "input_ids": list(segment.prompt_ids),
        "sampling_params": {
            "max_new_tokens": segment.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": True,
            "sampling_seed": segment.seed,
        },
        "return_logprob": True,
        "stream": False,
    }


def update_payload(folder: Path, version: int) -> dict[str, Any]:
    """The ``/update_weights_from_disk`` body (``UpdateWeightFromDiskReqInput`` fields)."""
    return {"model_path": str(folder), "weight_version": str(version), "flush_cache": True}


def parse_generate(body: Mapping[str, Any]) -> Delta:
    """Tokens, log-probs and finish reason of a ``/generate`` response."""
    meta = body["meta_info"]
    tokens = tuple(int(t) for t in body["output_ids"])
    logprobs = tuple(float(entry[0]) for entry in meta["output_token_logprobs"])
    if len(logprobs) != len(tokens):
        raise SGLangError(f"request {meta.get('id')!r}: {len(tokens)} tokens but {len(logprobs)} log-probs")
    finish = meta.get("finish_reason") or {}
    return Delta(tokens, logprobs, finish.get("type"))


class SGLangHTTP:
    """JSON POSTs to one server; one connection per call (a generation is one long call)."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"sglang.url: expected http://host:port, got {url!r}")
        self.host, self.port, self.timeout_s = parts.hostname, parts.port or 80, timeout_s

    async def post(self, path: str, payload: Mapping[str, Any]) -> Any:
        """POST ``payload`` as JSON; the decoded JSON answer (None for an empty body)."""
        return await asyncio.wait_for(self._post(path, payload), self.timeout_s)

    async def _post(self, path: str, payload: Mapping[str, Any]) -> Any:
        body = json.dumps(payload).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
        header, _, content = raw.partition(b"\r\n\r\n")
        status_line, *header_lines = header.decode("latin-1").split("\r\n")
        status = int(status_line.split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            content = _unchunk(content)
        if status >= 400:
            raise SGLangError(f"POST {path}: HTTP {status}: {content[:500].decode(errors='replace')}")
        return json.loads(content) if content.strip() else None


def _unchunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return bytes(out)


class SGLangBackend:
    """Segments as ``/generate`` calls on one SGLang server (``SegmentBackend``)."""

    def __init__(self, http: SGLangHTTP) -> None:
        self.http = http

    async def stream(self, segment: Segment) -> AsyncGenerator[Delta, None]:
        call = asyncio.ensure_future(self.http.post(ROUTES["generate"], generate_payload(segment)))
        try:
            yield parse_generate(await asyncio.shield(call))
        finally:
            if not call.done():  # closed early: stop it on the server, then collect the answer
                await self.abort(segment.segment_id)
                await asyncio.wait([call])

    async def abort(self, segment_id: str) -> None:
        await self.http.post(ROUTES["abort"], {"rid": segment_id})

    async def load(self, folder: Path, version: int) -> None:
        answer = await self.http.post(ROUTES["update_weights"], update_payload(folder, version))
        if not answer.get("success", False):
            raise SGLangError(f"update_weights_from_disk {folder}: {answer.get('message')}")

    async def pause(self) -> None:
        await self.http.post(ROUTES["pause"], {"mode": "in_place"})

    async def resume(self) -> None:
        await self.http.post(ROUTES["resume"], {})

    def close(self) -> None:
        """Nothing to stop: the server's lifetime is its owner's."""


class SGLangEngine(SegmentedEngine):
    """Generation on a running SGLang server that serves ``model_dir`` (module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        url: str = "http://127.0.0.1:30000",
        version: int = 0,
        weights_dir: str | Path = DEFAULT_ROOT,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(SGLangBackend(SGLangHTTP(url, timeout_s)), WeightFolders(model_dir, weights_dir), version)

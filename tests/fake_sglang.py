"""``FakeSGLangServer``: SGLang's native HTTP routes on a loopback port, for the SGLang engine's tests.

Not a Protocol fake (those are in ``fakes.py``): it stands in for an SGLang server process, so
``SGLangEngine`` runs its real HTTP client against it. Test helper only.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar


class FakeSGLangServer:
    """SGLang 0.5.23's native HTTP routes on a loopback port, with a scripted 'model'.

    Every body is recorded per route and checked for the keys the real request classes take
    (``FIELDS``; a test compares them with the wheel's). Generation continues the prefix:
    token ``(prev + shift) % vocab`` with log-prob ``-shift / 10 - 0.001 * prefix_length``, where
    ``shift`` comes from the loaded weights' float64 sum, so a weight load visibly changes the
    output and each token tells which weights made it. Tokens take ``token_s`` each; an abort or a
    pause takes effect between tokens, as in SGLang's scheduler.
    """

    ROUTES = ("/generate", "/abort_request", "/update_weights_from_disk", "/pause_generation",
              "/continue_generation")  # fmt: skip
    FIELDS: ClassVar[dict[str, set[str]]] = {
        "/generate": {"rid", "input_ids", "sampling_params", "return_logprob", "stream"},
        "sampling_params": {"max_new_tokens", "temperature", "top_p", "stop_token_ids", "ignore_eos", "sampling_seed"},
        "/abort_request": {"rid", "abort_all"},
        "/update_weights_from_disk": {"model_path", "weight_version", "flush_cache", "abort_all_requests"},
        "/pause_generation": {"mode"},
        "/continue_generation": {"torch_empty_cache"},
    }

    def __init__(self, model_dir: Any, vocab: int = 16, token_s: float = 0.002) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from sluice.engines.weight_folder import folder_weights, weights_checksum

        self.vocab, self.token_s = vocab, token_s
        self._checksum = lambda folder: weights_checksum(folder_weights(folder))
        self.shift = self._shift(self._checksum(model_dir))
        self.bodies: dict[str, list[dict[str, Any]]] = {route: [] for route in self.ROUTES}
        self.aborted: set[str] = set()
        self.running = threading.Event()
        self.resumed = threading.Event()
        self.resumed.set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                status, answer = server.handle(self.path, body)
                data = json.dumps(answer).encode() if answer is not None else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _shift(self, checksum: float) -> int:
        return 1 + int(abs(checksum) * 1000) % (self.vocab - 1)

    def expected_logprob(self, shift: int, prefix_length: int) -> float:
        return -shift / 10 - 0.001 * prefix_length

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path not in self.ROUTES:
            return 404, {"detail": "Not Found"}
        unknown = set(body) - self.FIELDS[path] | set(body.get("sampling_params", {})) - self.FIELDS["sampling_params"]
        if unknown:
            return 400, {"error": f"unknown fields {sorted(unknown)}"}
        self.bodies[path].append(body)
        if path == "/generate":
            return 200, self._generate(body)
        if path == "/abort_request":
            self.aborted.add(body["rid"])
        elif path == "/update_weights_from_disk":
            self.shift = self._shift(self._checksum(body["model_path"]))
            return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        elif path == "/pause_generation":
            self.resumed.clear()
        elif path == "/continue_generation":
            self.resumed.set()
        return 200, None

    def _generate(self, body: dict[str, Any]) -> dict[str, Any]:
        import time

        params, rid, ids = body["sampling_params"], body["rid"], list(body["input_ids"])
        tokens: list[int] = []
        logprobs: list[list[Any]] = []
        finish: dict[str, Any] = {"type": "length", "length": params["max_new_tokens"]}
        self.running.set()
        while len(tokens) < params["max_new_tokens"]:
            self.resumed.wait()
            if rid in self.aborted:
                finish = {"type": "abort", "message": "Abort in waiting queue"}
                break
            shift = self.shift
            token = (ids[-1] + shift) % self.vocab
            logprobs.append([self.expected_logprob(shift, len(ids)), token, None])
            tokens.append(token)
            ids.append(token)
            time.sleep(self.token_s)
            if token in params["stop_token_ids"]:
                finish = {"type": "stop", "matched": token}
                break
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(tokens), "output_token_logprobs": logprobs}  # fmt: skip
        return {"text": "", "output_ids": tokens, "meta_info": meta}

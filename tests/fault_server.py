"""An OpenAI-compatible completions server on loopback that fails a share of its requests on purpose.

A share `fail_rate` of the requests fail: requests are dealt in blocks, each holding every one of FAULTS
once and enough successes for that share, in an order shuffled per block. The faults: HTTP 500, 503, 429
with Retry-After, a connection dropped without an answer, a hang past the client's timeout, a 200 whose
body is not JSON, a 200 with JSON that is no object, a 200 whose body is cut short, a 200 without choices. The other requests get a 200
whose choice `i` reads `answer_text(prompt, temperature, seed, i)`; the server keeps every text it
answered with, so a test can check that a record holds the server's text.

With `token_latency` (seconds per token of the request's `max_tokens`) and `request_latency` (seconds per
request), every 200 (a good answer or a broken one) comes only after that long, as from a server that has
to generate the tokens first; errors and dropped connections come at once. Both are 0 by default. A
`fail_rate` of 0 answers every request.
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = ("500", "503", "429", "drop", "hang", "not_json", "not_object", "truncated", "no_choices")


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = 1024  # socketserver's 5 resets connections when many clients connect at once
    daemon_threads = True


def answer_text(prompt: str, temperature: float, seed: int, choice: int) -> str:
    digest = hashlib.sha256(prompt.encode()).hexdigest()[:12]
    return f"{digest} T={temperature} seed={seed} choice={choice}"


class FaultServer:
    """`with FaultServer(fail_rate, hang, seed) as server:` serves at `server.base_url` (`.../v1`)."""

    def __init__(
        self,
        fail_rate: float,
        hang: float,
        seed: int,
        token_latency: float = 0.0,
        request_latency: float = 0.0,
    ):
        self.fail_rate, self.hang = fail_rate, hang
        self.token_latency, self.request_latency = token_latency, request_latency
        self.rng = random.Random(seed)
        self.block: list[str] = []
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.served: set[str] = set()
        self.httpd = _HTTPServer(("127.0.0.1", 0), _handler(self))
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FaultServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def draw(self) -> str:
        """The fault for the next request, or "ok"."""
        with self.lock:
            if not self.block and self.fail_rate == 0:
                self.block = ["ok"]
            if not self.block:
                successes = round(len(FAULTS) * (1 - self.fail_rate) / self.fail_rate)
                self.block = [*FAULTS, *["ok"] * successes]
                self.rng.shuffle(self.block)
            fault = self.block.pop()
            self.counts[fault] += 1
            return fault

    def generate(self, body: dict) -> None:
        """Take as long as a server generating the request's `max_tokens` would."""
        delay = self.request_latency + self.token_latency * int(body.get("max_tokens", 16))
        if delay > 0:
            time.sleep(delay)

    def answer(self, body: dict, delivered: bool = True) -> bytes:
        """The 200 body for a request; its texts count as served when it is `delivered` whole."""
        prompt, temperature, seed = body["prompt"], float(body["temperature"]), int(body["seed"])
        texts = [answer_text(prompt, temperature, seed, i) for i in range(int(body.get("n", 1)))]
        if delivered:
            with self.lock:
                self.served.update(texts)
        choices = [
            {"index": i, "text": t, "finish_reason": "length", "logprobs": None} for i, t in enumerate(texts)
        ]
        usage = {"prompt_tokens": 3, "completion_tokens": 4 * len(texts), "total_tokens": 3 + 4 * len(texts)}
        payload = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
                   "choices": choices, "usage": usage}  # fmt: skip
        return json.dumps(payload).encode()


def _handler(server: FaultServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def reply(
            self, status: int, body: bytes, headers: dict[str, str] | None = None, length: int = 0
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(length or len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            fault = server.draw()
            error = json.dumps({"error": {"message": f"injected {fault}"}}).encode()
            if fault in ("500", "503"):
                self.reply(int(fault), error)
            elif fault == "429":
                self.reply(429, error, {"Retry-After": "1"})
            elif fault == "drop":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
            elif fault == "hang":
                time.sleep(server.hang)
                self.close_connection = True
            else:
                server.generate(body)
                self.answer_200(fault, body)

        def answer_200(self, fault: str, body: dict) -> None:
            if fault == "not_json":
                self.reply(200, b'{"id": "cmpl-1", "choices": [{"text": "unfinish')
            elif fault == "not_object":
                self.reply(200, b'["not", "an", "object"]')
            elif fault == "truncated":
                self.close_connection = True
                self.reply(200, server.answer(body, delivered=False)[:40], length=400)
            elif fault == "no_choices":
                self.reply(
                    200, json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": []}).encode()
                )
            else:
                self.reply(200, server.answer(body))

    return Handler


def main() -> None:
    """`python -m tests.fault_server FAIL_RATE HANG SEED [TOKEN_LATENCY [REQUEST_LATENCY]]`: serve until
    killed; prints the base URL first."""
    import sys

    fail_rate, hang, seed = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    latencies = [float(a) for a in sys.argv[4:6]]
    with FaultServer(fail_rate, hang, seed, *latencies) as server:
        print(server.base_url, flush=True)
        server.thread.join()


if __name__ == "__main__":
    main()

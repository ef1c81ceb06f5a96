"""A tiny real OpenAI-style streaming server for the benchmark client's tests (loopback, stdlib only).

POST /v1/completions streams SSE chunks for `max_tokens` tokens, one per chunk, in one of these modes:
- usage: text chunks, then a usage chunk (llama-server / vLLM style);
- token_ids: gpuserv style, two token ids per chunk, then usage;
- text: text chunks and no usage at all (the client must count);
- short: stops 2 tokens early and says so honestly in its usage;
- lying: streams 2 token ids fewer than its usage claims.
GET /health answers 200. Each response waits `first_delay` seconds before its first token.
Run as a script (`--port N --mode M`) to be a server process of its own.
"""

from __future__ import annotations

import argparse
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_handler(mode: str, first_delay: float):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes: SSE without a length

        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def _send(self, chunk: dict) -> None:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()

        def do_POST(self):
            if self.path != "/v1/completions":
                self.send_response(404)
                self.end_headers()
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
            n = int(body["max_tokens"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(first_delay)
            sent = n - 2 if mode in ("short", "lying") else n
            if mode in ("token_ids", "lying"):
                for i in range(0, sent, 2):
                    self._send({"choices": [{"index": 0, "text": "", "token_ids": list(range(i, min(i + 2, sent)))}]})
            else:
                for i in range(sent):
                    self._send({"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]})
            if mode != "text":
                usage = n if mode == "lying" else sent
                self._send({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": usage}})
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


def serve(port: int, mode: str, first_delay: float = 0.0) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(mode, first_delay))
    server.daemon_threads = True
    return server


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", default="usage")
    p.add_argument("--first-delay", type=float, default=0.0)
    a = p.parse_args()
    serve(a.port, a.mode, a.first_delay).serve_forever()

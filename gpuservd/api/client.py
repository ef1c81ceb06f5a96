"""A client for the daemon over its Unix socket (or TCP): used by the CLI and the console.

httpx only; no torch, no engine, so `gpuserv status` and the console start at
once. Errors are UserErrors with one-line messages: `DaemonUnavailable` when
nothing answers at the socket, `DaemonError` carrying the daemon's
OpenAI-shaped error (status, message, code) otherwise.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from gpuservd.errors import UserError
from gpuservd.paths import client_socket_path, private_dir_problem, user_socket
from gpuservd.wire.status import DaemonStatus

ADMIN_TIMEOUT = httpx.Timeout(30.0, connect=5.0)
LONG_TIMEOUT = httpx.Timeout(None, connect=5.0)  # generation, drain, model load: as long as they take


class DaemonUnavailable(UserError):
    """Nothing answers at the socket (no daemon, or a stale socket file)."""

    def __init__(self, where: str):
        self.where = where
        super().__init__(f"no daemon answers at {where}; start one with `gpuserv serve` "
                         f"(or `systemctl start gpuservd`)")


class DaemonError(UserError):
    """The daemon answered with an error."""

    def __init__(self, status: int, message: str, code: str | None = None, body: dict | None = None):
        super().__init__(f"daemon: {message} (HTTP {status})")
        self.status = status
        self.message = message
        self.code = code
        self.body = body or {}


@dataclass
class Delta:
    """One streamed piece of a completion."""

    text: str  # new text ("" for the opening chunk and the usage chunk)
    token_ids: list[int] | None  # new token ids (with return_token_ids)
    finish_reason: str | None  # set on the last content chunk
    usage: dict | None  # set on the usage chunk (stream_options.include_usage)
    logprobs: list | None = None  # with logprobs: [(token, logprob, [(token, logprob), ...])] per new token


def _logprobs(lp: dict | None) -> list | None:
    """Chat's {"content": [...]} or completions' {"tokens", "token_logprobs", "top_logprobs"}, as one list."""
    if not lp:
        return None
    if "content" in lp:
        return [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
                for e in lp["content"] or []]
    return [(t, v, list((top or {}).items())) for t, v, top in zip(lp["tokens"], lp["token_logprobs"],
                                                                     lp["top_logprobs"])]


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        err = resp.json().get("error", {})
        raise DaemonError(resp.status_code, err.get("message") or resp.text, err.get("code"), resp.json())
    except (json.JSONDecodeError, AttributeError, ValueError):
        raise DaemonError(resp.status_code, resp.text.strip()[:200] or resp.reason_phrase) from None


def _delta(chunk: dict) -> Delta:
    if "error" in chunk:
        err = chunk["error"]
        raise DaemonError(500, err.get("message", "stream failed"), err.get("code"), chunk)
    if not chunk.get("choices"):
        return Delta("", None, None, chunk.get("usage"))
    c = chunk["choices"][0]
    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
    return Delta(text or "", c.get("token_ids"), c.get("finish_reason"), chunk.get("usage"), _logprobs(c.get("logprobs")))


def _sse_payloads(lines) -> Iterator[dict]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _generation_body(model: str, stream: bool, params: dict) -> dict:
    body = {"model": model, "stream": stream, **{k: v for k, v in params.items() if v is not None}}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _connection(socket_path, base_url, token, transport_cls) -> tuple[str, dict]:
    """(where, httpx client kwargs): TCP when base_url is given, else the Unix socket the CLI would find."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if base_url:
        return base_url, dict(base_url=base_url, headers=headers, timeout=ADMIN_TIMEOUT)
    path = Path(socket_path) if socket_path else client_socket_path()
    if path == user_socket():  # a predictable path: never send a prompt to a socket someone else planted
        problem = private_dir_problem(path.parent)
        if problem:
            raise UserError(problem)
    kwargs = dict(transport=transport_cls(uds=str(path)), base_url="http://gpuserv", headers=headers,
                  timeout=ADMIN_TIMEOUT)
    return str(path), kwargs


class Client:
    """Synchronous client; `Client()` finds the socket like the CLI does ($GPUSERV_SOCKET, runtime dirs)."""

    def __init__(self, socket_path: str | Path | None = None, base_url: str | None = None, token: str | None = None):
        self.where, kwargs = _connection(socket_path, base_url, token, httpx.HTTPTransport)
        self._http = httpx.Client(**kwargs)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, body: dict | None = None, timeout=ADMIN_TIMEOUT) -> dict:
        try:
            resp = self._http.request(method, path, json=body, timeout=timeout)
        except (httpx.ConnectError, httpx.RemoteProtocolError, FileNotFoundError):
            raise DaemonUnavailable(self.where) from None
        _raise_for(resp)
        return resp.json()

    def _stream_lines(self, method: str, path: str, body: dict | None, params: dict | None = None) -> Iterator[str]:
        try:
            with self._http.stream(method, path, json=body, params=params, timeout=LONG_TIMEOUT) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _raise_for(resp)
                yield from resp.iter_lines()
        except (httpx.ConnectError, FileNotFoundError):
            raise DaemonUnavailable(self.where) from None

    # ---- admin ------------------------------------------------------------------------------------
    def health(self) -> dict:
        return self.request("GET", "/health")

    def status(self) -> DaemonStatus:
        return DaemonStatus.from_dict(self.request("GET", "/admin/status"))

    def status_dict(self) -> dict:
        return self.request("GET", "/admin/status")

    def models(self) -> list[dict]:
        return self.request("GET", "/v1/models")["data"]

    def load(self, name: str, pinned: bool = False) -> dict:
        return self.request("POST", f"/admin/models/{name}/load", {"pinned": pinned}, LONG_TIMEOUT)

    def unload(self, name: str, timeout: float | None = None, force: bool = False) -> dict:
        return self.request("POST", f"/admin/models/{name}/unload", {"timeout": timeout, "force": force},
                            LONG_TIMEOUT)

    def pin(self, name: str, pinned: bool = True) -> dict:
        return self.request("POST", f"/admin/models/{name}/pin", {"pinned": pinned})

    def reset_prefix_cache(self, name: str) -> dict:
        """Drop the model's prefix cache: {"model", "num_blocks_forgotten"}."""
        return self.request("POST", f"/admin/models/{name}/prefix_cache/reset")

    def set_versions(self, name: str, weights: dict | None) -> dict:
        """Split `name`'s traffic over versions by weight ({} or None: serve it as itself)."""
        return self.request("POST", f"/admin/models/{name}/versions", {"weights": weights or None})

    def drain(self, timeout: float | None = None, exit: bool = True) -> dict:
        return self.request("POST", "/admin/drain", {"timeout": timeout, "exit": exit}, LONG_TIMEOUT)

    def resume(self) -> dict:
        return self.request("POST", "/admin/resume")

    def reload(self) -> dict:
        return self.request("POST", "/admin/reload", None, LONG_TIMEOUT)

    def requests(self) -> list[dict]:
        return self.request("GET", "/admin/requests")["requests"]

    def cancel(self, request_id: str) -> dict:
        return self.request("POST", f"/admin/requests/{request_id}/cancel")

    def metrics(self) -> str:
        try:
            resp = self._http.get("/metrics")
        except (httpx.ConnectError, FileNotFoundError):
            raise DaemonUnavailable(self.where) from None
        _raise_for(resp)
        return resp.text

    def events(self, types: list[str] | None = None, recent: int = 0) -> Iterator[dict]:
        """The live event stream (NDJSON), one dict per event, until the daemon closes it."""
        params = {"recent": str(recent)}
        if types:
            params["types"] = ",".join(types)
        for line in self._stream_lines("GET", "/admin/events", None, params):
            if line.strip():
                yield json.loads(line)

    # ---- generation -------------------------------------------------------------------------------
    def completion(self, model: str, prompt: str | list[int], **params) -> dict:
        return self.request("POST", "/v1/completions", _generation_body(model, False, {"prompt": prompt, **params}),
                            LONG_TIMEOUT)

    def chat(self, model: str, messages: list[dict], **params) -> dict:
        return self.request("POST", "/v1/chat/completions",
                            _generation_body(model, False, {"messages": messages, **params}), LONG_TIMEOUT)

    def completion_stream(self, model: str, prompt: str | list[int], **params) -> Iterator[Delta]:
        body = _generation_body(model, True, {"prompt": prompt, **params})
        for chunk in _sse_payloads(self._stream_lines("POST", "/v1/completions", body)):
            yield _delta(chunk)

    def chat_stream(self, model: str, messages: list[dict], **params) -> Iterator[Delta]:
        body = _generation_body(model, True, {"messages": messages, **params})
        for chunk in _sse_payloads(self._stream_lines("POST", "/v1/chat/completions", body)):
            yield _delta(chunk)


class AsyncClient:
    """The asyncio twin of the admin half of `Client` (for the console)."""

    def __init__(self, socket_path: str | Path | None = None, base_url: str | None = None, token: str | None = None):
        self.where, kwargs = _connection(socket_path, base_url, token, httpx.AsyncHTTPTransport)
        self._http = httpx.AsyncClient(**kwargs)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(self, method: str, path: str, body: dict | None = None, timeout=ADMIN_TIMEOUT) -> dict:
        try:
            resp = await self._http.request(method, path, json=body, timeout=timeout)
        except (httpx.ConnectError, httpx.RemoteProtocolError, FileNotFoundError):
            raise DaemonUnavailable(self.where) from None
        _raise_for(resp)
        return resp.json()

    async def status(self) -> DaemonStatus:
        return DaemonStatus.from_dict(await self.request("GET", "/admin/status"))

    async def requests(self) -> list[dict]:
        return (await self.request("GET", "/admin/requests"))["requests"]

    async def cancel(self, request_id: str) -> dict:
        return await self.request("POST", f"/admin/requests/{request_id}/cancel")

    async def events(self, types: list[str] | None = None, recent: int = 0) -> AsyncIterator[dict]:
        params = {"recent": str(recent)}
        if types:
            params["types"] = ",".join(types)
        try:
            async with self._http.stream("GET", "/admin/events", params=params, timeout=LONG_TIMEOUT) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    _raise_for(resp)
                async for line in resp.aiter_lines():
                    if line.strip():
                        yield json.loads(line)
        except (httpx.ConnectError, FileNotFoundError):
            raise DaemonUnavailable(self.where) from None

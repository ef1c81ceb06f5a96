"""What one client's request can do to the others: sampling values that used to make an engine step
raise (and so fail every stream of the model), bodies that used to be 500s. Against the real daemon
over its socket; the hostile requests come from another uid (tests/hostile.py)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon_harness import DaemonProcess, make_home, stream_completion  # noqa: E402
from hostile import as_user, open_dir, remove  # noqa: E402

NUM_STREAMS = 6
STREAM_TOKENS = 120


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("security-requests")
    home = make_home(tmp, tiny_model_dir)
    sockdir = open_dir("gs-req-")
    d = DaemonProcess(tmp, home, socket_path=sockdir / "gs.sock", config={
        "scheduler": {"max_num_seqs": 16},
        "server": {"socket_mode": "0666"},  # a socket shared with every local user (as with socket_group)
    })
    try:
        with d:
            yield d
    finally:
        remove(sockdir)


def _stream(daemon, out: dict, i: int, started: threading.Barrier) -> None:
    body = {"model": "tiny", "prompt": f"stream {i}", "max_tokens": STREAM_TOKENS, "stream": True,
            "ignore_eos": True, "temperature": 0.7, "seed": i, "return_token_ids": True}
    stream_completion(daemon, body, out, i, started)


def _post_as_other_user(daemon, bodies: list) -> list:
    sock = str(daemon.socket)

    def send():
        answers = []
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://gpuserv", timeout=60) as c:
            for body in bodies:
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
                answers.append((r.status_code, r.json()))
        return answers

    return as_user(send)


POISON = [  # values that raised inside the sampler, or were let through unchecked
    ({"seed": 1208925819614629174706176}, 400, "seed"),
    ({"seed": -(2 ** 63) - 1}, 400, "seed"),
    ({"priority": 10 ** 30}, 400, "priority"),
    ({"top_k": 10 ** 30}, 400, "top_k"),
]


def test_poison_requests_beside_running_streams_fail_alone(daemon):
    out: dict = {}
    started = threading.Barrier(NUM_STREAMS + 1)
    threads = [threading.Thread(target=_stream, args=(daemon, out, i, started)) for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    started.wait(60)  # every stream has its 200 and is generating
    bodies = [{"model": "tiny", "prompt": "x", "max_tokens": 4, **extra} for extra, _, _ in POISON]
    bodies.append({"model": "tiny", "prompt": "x", "max_tokens": 4, "temperature": 1e-300, "seed": 3})
    bodies.append(b'{"model": "tiny", "prompt": "x", "max_tokens": 4, "temperature": NaN}')
    bodies.append(b'{"model": "tiny", "prompt": "x", "max_tokens": 4, "top_p": NaN}')
    answers = _post_as_other_user(daemon, bodies)
    for t in threads:
        t.join(180)
    for (extra, status, param), (got, body) in zip(POISON, answers):
        assert (got, body["error"]["param"]) == (status, param), (extra, body)
    tiny_t = answers[len(POISON)]
    assert tiny_t[0] == 200, tiny_t  # raised to the sampler's floor, not a failed step
    assert (answers[-2][0], answers[-2][1]["error"]["param"]) == (400, "temperature")  # NaN is not JSON
    assert (answers[-1][0], answers[-1][1]["error"]["param"]) == (400, "top_p")
    assert "NaN, which is not JSON" in answers[-1][1]["error"]["message"]
    assert out == {i: (200, STREAM_TOKENS, "length", []) for i in range(NUM_STREAMS)}


@pytest.mark.parametrize("raw,param,message", [
    (b'{"model": "tiny", "prompt": "x", "temperature": 1e999}', "temperature", "finite"),
    (b'{"model": "tiny", "prompt": "\\ud800 lone"}', "prompt", "lone surrogate"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None, "5000 digits"),
    (b'{"model": "tiny", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", None, "deeper than"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfff"}]}', "messages[0].content",
     "lone surrogate"),
    (b'{"model": "' + b"m" * 1000 + b'", "prompt": "x"}', "model", "not a model name"),
    (b'{"model": "../../etc", "prompt": "x"}', "model", "not a model name"),
], ids=["inf", "surrogate", "5000-digits", "deep", "chat-surrogate", "long-model", "path-model"])
def test_hostile_bodies_are_400_naming_the_problem(daemon, raw, param, message):
    route = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    with daemon.http() as c:
        r = c.post(route, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], err
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200

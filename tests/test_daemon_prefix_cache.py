"""Prefix caching through the real daemon over its socket: a repeated prompt reuses cached blocks
(same text), /admin/status and /metrics count the hits, and the admin call drops the cache."""

from __future__ import annotations

import re

import pytest

from daemon_harness import DaemonProcess, make_home

COMP = "/v1/completions"
PROMPT = ("You are a careful assistant. Answer briefly and cite the manual section. " * 3) + "Question: "


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("daemon-prefix")
    d = DaemonProcess(tmp, make_home(tmp, tiny_model_dir))  # engine.prefix_caching: true is the default
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop(wait_exit=False)


def _metric(text: str, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}{{model_name="tiny"}} ([0-9.e+]+)$', text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_repeated_prompt_hits_the_cache_and_reset_drops_it(daemon):
    def ask(suffix: str) -> dict:
        body = {"model": "tiny", "prompt": PROMPT + suffix, "max_tokens": 6, "temperature": 0}
        with daemon.http(timeout=60) as c:
            r = c.post(COMP, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    first = ask("what is a block?")
    st = daemon.status()["models"][0]["prefix_cache"]
    assert st["enabled"] and st["hit_tokens"] == 0 and st["query_tokens"] == first["usage"]["prompt_tokens"]
    second = ask("what is a block?")
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    st = daemon.status()["models"][0]["prefix_cache"]
    n = first["usage"]["prompt_tokens"]
    assert st["hit_tokens"] == (n - 1) // 4 * 4 and st["cached_blocks"] > 0  # block_size 4 in the harness
    with daemon.http() as c:
        text = c.get("/metrics").text
    assert _metric(text, "vllm:prefix_cache_hits_total") == st["hit_tokens"]
    assert _metric(text, "vllm:prefix_cache_queries_total") == 2 * n

    with daemon.http() as c:
        r = c.post("/admin/models/tiny/prefix_cache/reset")
        assert r.status_code == 200 and r.json()["num_blocks_forgotten"] > 0
        assert c.post("/admin/models/nope/prefix_cache/reset").status_code == 404
    third = ask("what is a block?")
    assert third["choices"][0]["text"] == first["choices"][0]["text"]
    after = daemon.status()["models"][0]["prefix_cache"]
    assert after["hit_tokens"] == st["hit_tokens"] and after["resets"] == 1  # nothing found after the reset

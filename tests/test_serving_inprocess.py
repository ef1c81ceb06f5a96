"""The app and its engine thread in this process, where faults can be injected.

Anything unexpected becomes a 500 whose body names a request id that is also in
the log, and the next request is served; an engine step that raises fails
only the requests it was running.
"""

from __future__ import annotations

import logging

import pytest

from inprocess_app import run_in_app

BODY = {"model": "tiny", "prompt": "the capital", "max_tokens": 3, "ignore_eos": True}


@pytest.fixture()
def home(store_home):
    """GPUSERV_HOME with the tiny model in its store (conftest's store_home)."""
    return store_home


def run_app(check):
    """Run check(client, serving) against a fresh in-process app with the tiny model loaded."""
    run_in_app(check, {"engine": {"kv_cache_bytes": "4MiB", "block_size": 4, "num_threads": 1},
                       "server": {"models": ["tiny"]}}, load=["tiny"])


def test_unexpected_error_is_500_with_a_logged_request_id(home, monkeypatch, caplog):
    async def check(client, serving):
        def boom(*a, **k):
            raise RuntimeError("injected fault")

        monkeypatch.setattr(serving, "_sampling", boom)
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 500
        err = r.json()["error"]
        rid = r.headers["x-request-id"]
        assert err["type"] == "server_error" and err["code"] == "internal_error" and rid in err["message"]
        assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)
        assert any("injected fault" in rec.exc_text for rec in caplog.records if rec.exc_text)
        monkeypatch.undo()
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert serving.slots["tiny"].num_in_flight == 0 and not serving.active

    caplog.set_level(logging.ERROR, logger="gpuservd")
    run_app(check)


def test_an_engine_step_that_raises_fails_its_requests_and_the_engine_goes_on(home, caplog):
    async def check(client, serving):
        engine = serving.slots["tiny"].loop.engine
        real_step = engine.step
        calls = {"n": 0}

        def flaky_step():
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("device fault")
            return real_step()

        engine.step = flaky_step
        r = await client.post("/v1/completions", json={**BODY, "max_tokens": 5})
        assert r.status_code == 500 and "internal error" in r.json()["error"]["message"]
        assert any("device fault" in rec.getMessage() for rec in caplog.records)
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 200
        snap = serving.slots["tiny"].loop.snapshot
        assert snap.num_engine_errors == 1 and snap.kv_blocks_used == 0
        metrics = (await client.get("/metrics")).text
        assert 'gpuserv_engine_errors_total{model_name="tiny"} 1.0' in metrics

    caplog.set_level(logging.ERROR, logger="gpuservd")
    run_app(check)


def test_requests_listing_and_status_in_process(home):
    async def check(client, serving):
        st = (await client.get("/admin/status")).json()
        assert st["models"][0]["name"] == "tiny" and st["state"] == "serving"
        assert (await client.get("/admin/requests")).json() == {"requests": []}
        r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": [
            {"role": "user", "content": "hi"}], "max_tokens": 4, "return_token_ids": True, "temperature": 0})
        choice = r.json()["choices"][0]
        assert len(choice["token_ids"]) == r.json()["usage"]["completion_tokens"] <= 4
        decode = (await client.get("/admin/status")).json()["models"][0]["decode"]  # how decode steps run
        assert decode["path"] == "eager" and decode["reason"] == "eager on cpu" and decode["captured"] == []

    run_app(check)

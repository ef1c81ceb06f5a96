"""One request's failure inside an engine step fails that request alone; the rest of the batch
finishes with every token. In the engine (a row whose sampling raises for real: a logit_bias token id
outside the vocabulary, set after validation) and through the real daemon with >= 4 streams running
(the sampler made to raise for one request by a sitecustomize in the daemon process only)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon_harness import ROOT, DaemonProcess, make_home, stream_completion  # noqa: E402

from gpuservd.config import EngineConfig  # noqa: E402
from gpuservd.engine.engine import LLMEngine  # noqa: E402
from gpuservd.engine.request import SamplingParams  # noqa: E402

POISON_SEED = 666013
NUM_STREAMS = 5
STREAM_TOKENS = 80


def test_a_row_that_raises_fails_alone_in_the_engine(tiny_model_dir):
    engine = LLMEngine("tiny", tiny_model_dir, EngineConfig(model="tiny", kv_cache_bytes=4 << 20, block_size=4,
                                                            num_threads=1))
    free = engine.pool.num_free
    for i in range(4):
        engine.add_request(f"ok{i}", [5, 6, 7, 8 + i], SamplingParams(max_tokens=30, temperature=0.8, seed=i,
                                                                      ignore_eos=True))
    bad = engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.8, seed=9,
                                                              ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.rows.take() == []
    # Past validation (the vocabulary check ran at add_request): a bias on a token id the model does not
    # have makes the sampler's index_put raise for this row.
    bad.params.logit_bias = {engine.runner.arch.vocab_size + 5: 1.0}
    failed = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason.value
        failed += engine.rows.take()
    assert [rid for rid, _ in failed] == ["bad"] and isinstance(failed[0][1], (IndexError, RuntimeError))
    assert {rid: len(t) for rid, t in tokens.items() if rid != "bad"} == {f"ok{i}": 30 for i in range(4)}
    assert finish == {"bad": "abort", **{f"ok{i}": "length" for i in range(4)}}
    assert "bad" not in engine.requests and engine.pool.num_free == free  # its KV blocks are back


def test_the_batch_still_fails_when_no_single_row_does(tiny_model_dir, monkeypatch):
    engine = LLMEngine("tiny", tiny_model_dir, EngineConfig(model="tiny", kv_cache_bytes=4 << 20, block_size=4,
                                                            num_threads=1))
    from gpuservd.engine import sampler

    real = sampler.sample

    def batch_only(logits, requests, *args, **kw):  # a fault of the batch, not of any request in it
        if len(requests) > 1:
            raise RuntimeError("device fault")
        return real(logits, requests, *args, **kw)

    monkeypatch.setattr(sampler, "sample", batch_only)
    for i in range(2):
        engine.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="device fault"):
        engine.step()


INJECT = f'''
# Makes the engine's sampler raise for any batch holding the request seeded {POISON_SEED}: a stand-in
# for a sampling value that gets past validation. Only this daemon process loads it.
import gpuservd.engine.sampler as _sampler

_real = _sampler.sample


def _sample(logits, requests, *args, **kw):
    if any(r.params.seed == {POISON_SEED} for r in requests):
        raise RuntimeError("injected sampler failure")
    return _real(logits, requests, *args, **kw)


_sampler.sample = _sample
'''


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("blast-radius")
    home = make_home(tmp, tiny_model_dir)
    inject = tmp / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    d = DaemonProcess(tmp, home, config={"scheduler": {"max_num_seqs": 16}},
                      env={"PYTHONPATH": f"{inject}:{ROOT}"})
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop(wait_exit=False)


def test_a_failing_row_beside_running_streams_fails_alone(daemon):
    out: dict = {}
    started = threading.Barrier(NUM_STREAMS + 1)
    threads = [threading.Thread(target=stream_completion, args=(daemon, {
        "model": "tiny", "prompt": f"stream {i}", "max_tokens": STREAM_TOKENS, "stream": True, "ignore_eos": True,
        "temperature": 0.8, "seed": i, "return_token_ids": True}, out, i, started)) for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    started.wait(60)  # every stream is generating
    poison = {"model": "tiny", "prompt": "poison", "max_tokens": 50, "stream": True, "ignore_eos": True,
              "temperature": 0.8, "seed": POISON_SEED, "return_token_ids": True}
    stream_completion(daemon, poison, out, "poison", None)
    with daemon.http() as c:  # the same, not streamed: a 500 naming the request
        r = c.post("/v1/completions", json={**poison, "stream": False})
    for t in threads:
        t.join(180)
    assert out.pop("poison")[3][0]["code"] == "internal_error"
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert r.headers["x-request-id"] in r.json()["error"]["message"]
    assert out == {i: (200, STREAM_TOKENS, "length", []) for i in range(NUM_STREAMS)}
    st = daemon.status()["models"][0]
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["num_running"] == 0
    assert "injected sampler failure" in daemon.log and r.headers["x-request-id"] in daemon.log

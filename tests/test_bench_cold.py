"""The cold-start benchmark on the tiny model: every strategy measured, INT8 quality reported."""

from __future__ import annotations

import json


def test_cold_start_bench_writes_all_strategies(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("GPUSERV_HOME", str(tmp_path / "home"))
    from gpuservd.bench.cold import STRATEGIES, run_cold_start
    from gpuservd.store.store import ModelStore

    ModelStore().import_dir(tiny_model_dir, "tiny")
    out = tmp_path / "out"
    r = run_cold_start("tiny", out, prompt_tokens=16, initial_layers=1, repeats=1, log=lambda m: None)
    assert set(r["summary"]) == set(STRATEGIES)
    for s in STRATEGIES:
        assert 0 < r["summary"][s]["engine_ready_s"] <= r["summary"][s]["ttft_s"]
        assert r["summary"][s]["read_floor_s"] > 0  # the disk's own time for the bytes each strategy reads
    # The INT8 file moves about a quarter of the fp32 bytes.
    assert r["summary"]["layered+int8"]["bytes_read"] < 0.35 * r["summary"]["full"]["bytes_read"]
    q = r["int8_quality"]
    assert 0 <= q["greedy_token_agreement"] <= 1 and q["max_logit_diff"] > 0
    saved = json.loads((out / "result.json").read_text())
    assert saved["model"] == "tiny" and saved["device"] == "cpu" and saved["dtype"] == "float32"
    assert (out / "cold_start.png").stat().st_size > 1000 and "| layered+int8 |" in (out / "result.md").read_text()

"""The cold-start benchmark on the tiny model: every strategy measured, INT8 quality reported."""

from __future__ import annotations

import json


def test_cold_start_bench_writes_all_strategies(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("GPUSERV_HOME", str(tmp_path / "home"))
    from gpuservd.bench.cold import STRATEGIES, run_cold_start
    from gpuservd.store.store import ModelStore

    ModelStore().import_dir(tiny_model_dir, "tiny")
    out = tmp_path / "out"
    r = run_cold_start("tiny", out, prompt_tokens=16, initial_layers=1, repeats=1, log=lambda m: None,
                       dtype="float32")
    assert set(r["summary"]) == set(STRATEGIES)
    for s in STRATEGIES:
        assert 0 < r["summary"][s]["engine_ready_s"] <= r["summary"][s]["ttft_s"]
        assert r["summary"][s]["read_floor_s"] > 0  # the disk's own time for the bytes each strategy reads
        v = r["summary"][s]
        assert v["ttft_vs_read_floor"] == v["ttft_s"] / v["read_floor_s"] and v["warm_ttft_s"] > 0
        assert v["bound_s"] == max(v["read_floor_s"], v["warm_ttft_s"]) and v["cpu_to_first_token_s"] > 0
        assert all(run["cached_before"] <= 0.5 for run in r["runs"][s])  # the cache really was dropped
    # the bytes read are counted by the loads themselves: the tensors' bytes, not the files' sizes
    model_file = ModelStore().path("tiny") / "model.safetensors"
    assert 0.99 * model_file.stat().st_size < r["summary"]["full"]["bytes_read"] < model_file.stat().st_size
    # The INT8 file moves about a quarter of the fp32 bytes.
    assert r["summary"]["layered+int8"]["bytes_read"] < 0.35 * r["summary"]["full"]["bytes_read"]
    # Group-wise INT8 keeps the model's own next token at nearly every position (94.8% on this random
    # model, whose near-flat logits flip easily; a 2x scale error drops it far lower: test_int8_agreement)
    q = r["int8_quality"]
    assert q["teacher_forced_top1"] >= 0.9 and q["positions"] > 8 * 32 and q["group_size"] == 32
    assert q["free_running"]["replies"] == 8 and q["greedy_token_agreement"] == q["free_running"]["token_agreement"]
    from gpuservd.weights.int8_file import read_agreement

    assert read_agreement(ModelStore().path("tiny"))["teacher_forced_top1"] == q["teacher_forced_top1"]
    saved = json.loads((out / "result.json").read_text())
    assert saved["model"] == "tiny" and saved["device"] == "cpu" and saved["dtype"] == "float32"
    assert (out / "cold_start.png").stat().st_size > 1000 and "| layered+int8 |" in (out / "result.md").read_text()
    assert f"teacher-forced top-1 {100 * q['teacher_forced_top1']:.2f}%" in (out / "result.md").read_text()

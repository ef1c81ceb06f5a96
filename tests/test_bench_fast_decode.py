"""The fast-decode benchmark runs end to end on the CPU at tiny sizes, so it is known to work before a
GPU machine (where its numbers come from) ever runs it."""

from __future__ import annotations

import json

from gpuservd.bench import fast_decode


def test_smoke_run_writes_steps_json(tmp_path, ops):
    out = tmp_path / "fast"
    assert fast_decode.main(["--device", "cpu", "--smoke", "--out", str(out)]) == 0
    steps = json.loads((out / "steps.json").read_text())
    assert [(r["batch"], r["context"]) for r in steps] == fast_decode.SMOKE_POINTS
    for r in steps:
        assert set(r) >= {"model", "batch", "context", "eager_ms", "graph_ms", "ceiling_ms", "floor_ms"}
        assert r["graph_ms"] is None  # no graphs on a CPU
        assert r["eager_ms"] > 0 and r["fixed_ms"] > 0 and r["ceiling_ms"] > 0 and r["floor_ms"] > 0
        assert r["sampled_ms"] > 0
    result = json.loads((out / "result.json").read_text())
    assert result["greedy"]["graph_equals_fixed_eager"]  # on the CPU both run the fixed-shape step eagerly
    assert result["greedy"]["tokens"] == 4 * 6
    assert result["greedy"]["overlap_equals_graph"] and result["greedy"]["sampled_graph_equals_fixed"]
    runs = result["throughput"]
    assert [(r["graphs"], r["overlap"]) for r in runs] == [(False, False), (True, False), (True, True)]
    assert all(r["complete"] for r in runs)
    assert runs[0]["output_tokens"] == runs[1]["output_tokens"] == runs[2]["output_tokens"] > 0  # all ran to length
    assert all(r["decode_path"] == "eager" for r in runs)  # graphs asked for on a CPU: reported fallback
    assert "| tiny-shape | 3 | 24 |" in (out / "result.md").read_text()
    (mixed,) = result["mixed"]
    assert mixed["one_eager_batch_ms"] > 0 and mixed["prefill_eager_plus_decode_graph_ms"] > 0

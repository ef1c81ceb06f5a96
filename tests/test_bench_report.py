"""The benchmark report on hand-built runs: exact percentiles, ratios, files written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpuservd.bench.floor import decode_floor_s, floor_summary, weight_bytes_per_decode_step
from gpuservd.bench.records import RequestTiming, SystemRun
from gpuservd.bench.report import percentiles, write_report


class FakeWorkload:
    name = "hand-built"
    path = None

    def class_names(self):
        return ["short", "long"]


def make_run(system: str, latencies: dict[str, list[float]], ttft: float, wall: float, tokens: int = 10) -> SystemRun:
    """Requests arriving at 1.0 s with the given latencies per class; every one made `tokens` tokens."""
    reqs = []
    for cls, lats in latencies.items():
        for i, lat in enumerate(lats):
            reqs.append(RequestTiming(f"{cls}-{i}", cls, arrival_s=1.0, first_token_s=1.0 + ttft,
                                      finish_s=1.0 + lat, prompt_tokens=8, output_tokens=tokens))
    return SystemRun(system=system, wall_s=wall, requests=reqs, extra={"dtype": "float32", "num_threads": 2})


def test_percentiles_linear_interpolation():
    vals = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    assert percentiles(vals) == {"p50": 6.0, "p90": 10.0, "p99": pytest.approx(10.9)}
    assert percentiles([1.0, 2.0]) == {"p50": 1.5, "p90": pytest.approx(1.9), "p99": pytest.approx(1.99)}
    assert percentiles([]) is None


def test_report_numbers_and_ratios(tmp_path):
    ours = make_run("gpuserv", {"short": [1.0, 2.0, 3.0, 4.0, 5.0], "long": [10.0]}, ttft=0.5, wall=10.0)
    peer = make_run("hf_static", {"short": [2.0, 4.0, 6.0, 8.0, 10.0], "long": [40.0]}, ttft=2.0, wall=40.0)
    fl = floor_summary(500_000_000, 16e9, 0.040)
    res = write_report(tmp_path, FakeWorkload(), [ours, peer], fl, {"dtype": "float32", "num_threads": 2})

    g = res["systems"]["gpuserv"]
    assert g["num_requests"] == 6 and g["generated_tokens"] == 60 and g["wall_s"] == 10.0
    assert g["throughput_tok_s"] == pytest.approx(6.0)
    assert g["latency_s"]["short"] == {"p50": 3.0, "p90": pytest.approx(4.6), "p99": pytest.approx(4.96)}
    assert g["latency_s"]["long"]["p50"] == 10.0
    assert g["latency_s"]["all"]["p50"] == pytest.approx(3.5)
    assert g["ttft_s"]["all"] == {"p50": 0.5, "p90": 0.5, "p99": 0.5}

    r = res["ratios"]["hf_static"]
    assert r["throughput"] == pytest.approx(4.0)  # 6 tok/s vs 1.5 tok/s
    assert r["latency_p50"]["short"] == pytest.approx(0.5)
    assert r["latency_p99"]["short"] == pytest.approx(0.5)
    assert r["latency_p99"]["long"] == pytest.approx(0.25)
    assert r["ttft_p50"]["all"] == pytest.approx(0.25)
    assert "gpuserv" not in res["ratios"]

    assert res["floor"]["floor_step_ms"] == pytest.approx(31.25)
    assert res["floor"]["ratio"] == pytest.approx(40.0 / 31.25)
    assert res["meta"]["dtype"] == "float32" and res["meta"]["threads"] == 2
    assert res["meta"]["host"]["cores"] >= 1 and res["meta"]["workload"]["name"] == "hand-built"

    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert on_disk["systems"]["gpuserv"]["latency_s"]["all"]["p99"] == pytest.approx(g["latency_s"]["all"]["p99"])
    md = (tmp_path / "result.md").read_text()
    assert "| gpuserv |" in md and "gpuserv / hf_static" in md and "4.00x" in md and "floor" in md
    png = (tmp_path / "latency_cdf.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_report_single_system(tmp_path):
    only = make_run("gpuserv", {"short": [1.0, 2.0]}, ttft=0.1, wall=2.0)
    res = write_report(tmp_path / "out", None, [only], None, {})
    assert res["ratios"] == {} and res["floor"] is None
    assert res["classes"] == ["short"]
    assert res["systems"]["gpuserv"]["latency_s"]["short"]["p50"] == 1.5
    assert (tmp_path / "out" / "latency_cdf.png").exists() and (tmp_path / "out" / "result.md").exists()


def test_weight_bytes_smollm2_and_floor():
    smollm2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
               "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152, "model_type": "llama",
               "tie_word_embeddings": True}
    # 134.5 M parameters, all but the 576-wide norms are read once per step.
    assert weight_bytes_per_decode_step(smollm2, 4) == 537_919_488
    assert weight_bytes_per_decode_step(smollm2, 2) == 537_919_488 // 2
    assert decode_floor_s(537_919_488, 16e9) == pytest.approx(0.03362, rel=1e-3)
    with pytest.raises(ValueError):
        decode_floor_s(1, 0)


def test_report_modules_do_not_import_torch():
    code = ("import sys, gpuservd.bench.report, gpuservd.bench.workload, gpuservd.bench.records, "
            "gpuservd.bench.floor, gpuservd.bench.peers; "
            "bad = [m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_foreign_load_reads_the_machine():
    from gpuservd.bench.floor import ForeignLoad

    with ForeignLoad() as load:
        sum(range(200_000))  # our own CPU time is not foreign
    if load.share is not None:  # Linux: /proc/stat exists
        assert load.foreign_cpu_s >= 0 and 0 <= load.share


def test_the_floor_probe_takes_the_best_of_several_reads_with_the_engines_threads():
    from gpuservd.bench.floor import best_bandwidth

    seen, reads = [], iter([13.3e9, 22.8e9, 18.0e9])

    def probe(threads):
        seen.append(threads)
        return next(reads)

    best, readings = best_bandwidth(2, probe=probe, runs=3, earlier=(15.0e9,))
    assert seen == [2, 2, 2] and best == 22.8e9 and readings == [15.0e9, 13.3e9, 22.8e9, 18.0e9]
    with pytest.raises(ValueError):
        best_bandwidth(2, probe=lambda t: 0.0, runs=2)


def test_a_step_that_beats_the_floor_says_the_probe_was_wrong_never_a_ratio_under_1(tmp_path):
    from gpuservd.bench.floor import best_bandwidth

    # The AVX2 machine's case: 538 MB of fp32 weights, a probe that read 13.3 GB/s (floor 40.4 ms) and a
    # measured 31.4 ms step. A second probe reading 22.8 GB/s lowers the floor to 23.6 ms: it holds.
    weights = 538_000_000
    one = floor_summary(weights, best_bandwidth(2, probe=lambda t: 13.3e9, runs=1)[0], 0.0314, [13.3e9])
    assert one["ratio"] is None and one["probe_wrong"]
    assert one["step_implied_bandwidth_gbs"] == pytest.approx(weights / 0.0314 / 1e9)
    assert "the bandwidth probe was wrong" in one["note"] and "40.5 ms" in one["note"]
    reads = iter([13.3e9, 22.8e9])
    best, readings = best_bandwidth(2, probe=lambda t: next(reads), runs=2)
    two = floor_summary(weights, best, 0.0314, readings)
    assert not two["probe_wrong"] and two["ratio"] == pytest.approx(0.0314 / (weights / 22.8e9)) and two["ratio"] >= 1
    assert two["probe_readings_gbs"] == [13.3, 22.8]
    # the report prints the verdict, never a ratio under 1
    ours = make_run("gpuserv", {"short": [1.0]}, ttft=0.1, wall=1.0)
    md = (tmp_path / "result.md")
    write_report(tmp_path, FakeWorkload(), [ours], one, {"dtype": "float32", "num_threads": 2})
    text = md.read_text()
    assert "the probe was wrong" in text and "ratio 0." not in text
    write_report(tmp_path, FakeWorkload(), [ours], two, {"dtype": "float32", "num_threads": 2})
    assert f"ratio {two['ratio']:.2f}" in md.read_text()


def test_report_names_the_longest_request_and_its_completion_in_each_config(tmp_path):
    """The starvation check reads from one run: the longest request (most output tokens) is found once and
    its completion compared across configs, gpuserv (the --config) over each --compare."""
    def run(system, long_finish):
        reqs = [RequestTiming("short-0", "short", 0.0, 0.5, 3.0, 8, 16),
                RequestTiming("long-0", "long", 0.0, 1.0, 20.0, 8, 300),
                RequestTiming("long-1", "long", 0.0, 1.0, long_finish, 8, 400)]
        return SystemRun(system, long_finish, reqs, {})

    res = write_report(tmp_path, FakeWorkload(), [run("gpuserv", 44.0), run("gpuserv[fcfs]", 40.0)], None, {})
    top = res["longest_request"]
    assert top["request_id"] == "long-1" and top["output_tokens"] == 400 and top["cls"] == "long"
    assert top["completion_s"] == {"gpuserv": 44.0, "gpuserv[fcfs]": 40.0}
    assert top["gpuserv_over"] == {"gpuserv[fcfs]": pytest.approx(1.1)}
    assert res["systems"]["gpuserv[fcfs]"]["latency_s"]["long"]["p99"] == pytest.approx(39.8)  # per-class P99
    md = (tmp_path / "result.md").read_text()
    assert "Longest request long-1 (long, 8 + 400 tokens)" in md and "gpuserv / gpuserv[fcfs] 1.10x" in md
    assert json.loads((tmp_path / "result.json").read_text())["longest_request"]["completion_s"]["gpuserv"] == 44.0

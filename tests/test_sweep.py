"""`gpuserv bench sweep` (plateau finding, a real sweep on the tiny model, the daemon reading its result) and
`gpuserv bench` as a group: the promised `bench -w FILE ...` form passes every option through unchanged."""

from __future__ import annotations

import json

import pytest

from gpuservd.bench import sweep
from cli_invoke import invoke
from gpuservd.bench.sweep import find_knee, find_plateau


def curve(*values):
    return [{"batch": b, "tokens_s": v} for b, v in zip((1, 2, 4, 8, 16, 32, 64), values)]


def test_plateau_is_the_first_batch_within_ten_percent_of_the_best():
    p = find_plateau(curve(30, 58, 100, 160, 190, 200, 195))
    assert p == {"batch": 16, "tokens_s": 190, "best_batch": 32, "best_tokens_s": 200, "flattened": True}


def test_a_curve_still_growing_has_no_plateau_in_range():
    p = find_plateau(curve(30, 60, 120, 240))
    assert p["batch"] == 8 and not p["flattened"]
    assert find_plateau(curve(30, 60, 120, 125))["flattened"]
    with pytest.raises(ValueError):
        find_plateau([])


def test_knee_is_the_last_batch_whose_step_stays_near_the_smallest():
    pts = [{"batch": b, "step_ms": ms, "tokens_s": b / ms * 1000}
           for b, ms in zip((1, 2, 4, 8, 16, 32), (24.4, 22.3, 24.6, 24.9, 38.5, 79.3))]
    k = find_knee(pts)
    assert k["batch"] == 8 and k["step_ms"] == 24.9 and k["vs_smallest"] == pytest.approx(24.9 / 24.4, abs=1e-3)
    assert find_knee(pts[:1])["batch"] == 1
    assert find_knee(pts, factor=2.0)["batch"] == 16


@pytest.fixture
def swept(tmp_path, monkeypatch, tiny_model_dir, capsys):
    monkeypatch.setenv("GPUSERV_HOME", str(tmp_path / "home"))
    from gpuservd.store.store import ModelStore

    ModelStore().import_dir(tiny_model_dir, "tiny")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("engine:\n  kv_cache_bytes: 4MiB\n  block_size: 4\n  num_threads: 1\n")
    out = tmp_path / "out"
    code = invoke("bench", "sweep", "--model", "tiny", "--config", str(cfg), "--batches", "4,1,2", "--steps", "2",
                  "--prompt-tokens", "8", "--prefill-chunk", "16", "--out", str(out))
    assert code == 0
    return out, capsys.readouterr().out


def test_sweep_on_the_tiny_model_writes_json_markdown_and_plot(swept):
    swept, stdout = swept
    r = json.loads((swept / "result.json").read_text())
    assert [p["batch"] for p in r["points"]] == [1, 2, 4] == [p["batch"] for p in r["points_prefill_heavy"]]
    for p in r["points"] + r["points_prefill_heavy"]:
        assert p["tokens_s"] > 0 and p["step_ms"] > 0 and p["num_steps"] == 2
    assert r["plateau_batch"] == r["recommended"]["decode_heavy"] == r["plateau"]["decode_heavy"]["batch"]
    assert r["recommended"]["prefill_heavy"] in (1, 2, 4) and r["prefill_chunk"] == 16
    md = (swept / "result.md").read_text()
    assert "| 4 |" in md and "recommended `max_num_seqs:" in md and "prefill-heavy" in md
    assert (swept / "sweep.png").stat().st_size > 1000
    assert "decode-heavy: plateau at batch" in stdout
    assert r["knee"]["decode_heavy"]["batch"] in (1, 2, 4) and "decode-heavy knee: batch" in md


@pytest.mark.parametrize("chunk", [0, 16])
def test_a_point_is_the_median_of_the_engines_own_steps_of_exactly_that_batch(store_home, chunk):
    """The engine's step records (not the sweep) decide: the point's step time is the median wall time of the
    steps that carried exactly `batch` decode tokens and the `chunk`-token prefill, and no other steps."""
    import statistics

    import numpy as np

    from gpuservd.config import load_config
    from gpuservd.engine.engine import LLMEngine

    cfg = load_config(None)
    cfg.model, cfg.dtype, cfg.kv_cache_bytes, cfg.block_size, cfg.num_threads = "tiny", "float32", 4 << 20, 4, 1
    cfg.scheduler.max_num_seqs = 4
    cfg.preemption.mode = "off"
    engine = LLMEngine.from_store("tiny", cfg)
    first = engine.telemetry.num_steps
    p = sweep._measure(engine, 3, 8, 5, chunk, np.random.default_rng(0), "t")
    recs = engine.telemetry.recent(engine.telemetry.num_steps - first)
    exact = [r.wall_s for r in recs if r.num_decode_tokens == 3 and r.num_prefill_tokens == chunk][:5]
    assert len(recs) > len(exact) == p["num_steps"] == 5  # the batch's own prefill steps were left out
    assert p["step_ms"] == pytest.approx(1000 * statistics.median(exact), abs=1e-5)
    assert p["batch"] == 3 and p["tokens_s"] == pytest.approx(3000 / p["step_ms"], rel=1e-3)
    assert not engine.has_unfinished()


def test_the_daemon_reads_the_latest_sweep(swept):
    swept = swept[0]
    from gpuservd.hints.monitor import _sweeps
    from gpuservd.hints.sweeps import latest_sweep

    latest = latest_sweep("tiny")
    assert latest["plateau_batch"] == json.loads((swept / "result.json").read_text())["plateau_batch"]
    assert latest["path"].endswith("sweeps/tiny.json")
    assert _sweeps({"tiny": {}, "other": {}}) == {"tiny": latest}


def test_sweep_errors_are_one_line(tmp_path, monkeypatch, capsys, tiny_model_dir):
    assert invoke("bench", "sweep", "--model", "tiny", "--batches", "0,2") == 2
    assert "--batches" in capsys.readouterr().err
    assert invoke("bench", "-w", "x.yaml", "sweep") == 2
    assert "does not go with" in capsys.readouterr().err


def test_bench_keeps_its_promised_options(monkeypatch, tmp_path, capsys):
    """`gpuserv bench -w FILE` with every option reaches run_bench unchanged (the promised form)."""
    seen = {}

    def fake_run_bench(workload, config, peers, out, model=None, log=None, compare=None, alone_without=None,
                       repeats=1, http=False):
        seen.update(workload=workload, config=config, peers=peers, out=out, model=model, compare=compare,
                    alone_without=alone_without, http=http)
        return {"fake": True}

    import gpuservd.bench.report as report
    import gpuservd.bench.run as run

    monkeypatch.setattr(run, "run_bench", fake_run_bench)
    monkeypatch.setattr(report, "markdown", lambda result: "REPORT")
    code = invoke("bench", "-w", "wl.yaml", "-c", "base.yaml", "--peers", "hf_static", "--out", "o", "-m", "tiny",
                  "--compare", "a.yaml", "--compare", "b.yaml", "--alone-without", "long")
    assert code == 0 and capsys.readouterr().out.strip() == "REPORT"
    assert {k: str(v) if not isinstance(v, list) else [str(x) for x in v] for k, v in seen.items()} == {
        "workload": "wl.yaml", "config": "base.yaml", "peers": ["hf_static"], "out": "o", "model": "tiny",
        "compare": ["a.yaml", "b.yaml"], "alone_without": "long", "http": "False"}
    assert invoke("bench", "--workload", "wl.yaml", "--target", "socket", "--config", "c.yaml") == 2
    assert "apply to --target inprocess" in capsys.readouterr().err
    assert invoke("bench", "--peers", "none") == 2  # --workload is still required without a subcommand
    assert "Missing option '--workload'" in capsys.readouterr().err

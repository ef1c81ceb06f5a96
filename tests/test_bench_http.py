"""The shared streaming client, the HTTP-target procedure and the report, against a stub OpenAI server.

No peer is installed here: the stub (tests/stub_openai_server.py) is a real HTTP server on loopback,
in a thread or as a process of its own.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from gpuservd.bench import http_peers
from gpuservd.bench.http_client import Endpoint, replay
from gpuservd.bench.http_peers import run_http_peer, run_server
from gpuservd.bench.peer_job import PeerJob, PeerUnavailable
from gpuservd.bench.records import SystemRun
from gpuservd.bench.report import write_report
from gpuservd.bench.server_process import ServerSpec, free_port
from gpuservd.bench.workload import WorkloadRequest

sys.path.insert(0, str(Path(__file__).parent))
from stub_openai_server import serve  # noqa: E402

STUB = Path(__file__).parent / "stub_openai_server.py"
LENGTHS = [5, 8, 3, 12]
DELAY = 0.05


def requests():
    return [WorkloadRequest(f"r{i}", "short" if n < 10 else "long", 0.01 * i, [7] * (4 + i), n)
            for i, n in enumerate(LENGTHS)]


@pytest.fixture
def stub():
    """Start a stub in a thread for one mode; yields a function mode -> Endpoint."""
    servers = []

    def start(mode: str) -> Endpoint:
        server = serve(0, mode, DELAY)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return Endpoint(base_url=f"http://127.0.0.1:{server.server_address[1]}", model="m")

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.mark.parametrize("mode, source", [("usage", "usage"), ("token_ids", "usage"), ("text", "text_chunks")])
def test_exact_streams_are_counted_and_timed(stub, mode, source):
    reqs = requests()
    rep = replay(stub(mode), reqs, warm_prompt=[1, 2, 3])
    check = rep.token_check(reqs)
    assert check["ok"] and check["source"] == source and not rep.errors and not rep.problems
    assert [t.request_id for t in rep.timings] == [r.request_id for r in reqs]
    assert [t.output_tokens for t in rep.timings] == LENGTHS
    for t, r in zip(rep.timings, reqs):
        # The stub holds every first token back by DELAY: TTFT can not be shorter.
        assert t.arrival_s == r.arrival_s and t.ttft_s >= DELAY and t.first_token_s <= t.finish_s <= rep.wall_s


@pytest.mark.parametrize("mode", ["short", "lying"])
def test_a_short_stream_is_caught(stub, mode):
    reqs = requests()
    rep = replay(stub(mode), reqs)
    check = rep.token_check(reqs)
    assert not check["ok"] and check["num_wrong_length"] == len(reqs)
    why = {rid: reason for rid, _, _, reason in rep.problems}
    if mode == "short":  # honest usage, two tokens short
        assert [t.output_tokens for t in rep.timings] == [n - 2 for n in LENGTHS]
        assert why["r0"] == "usage.completion_tokens = 3, expected 5"
    else:  # usage claims the full length; the streamed token ids give it away
        assert why["r0"] == "streamed 3 token ids but usage says 5"


def test_a_failed_request_is_an_error_not_a_timing(stub):
    ep = stub("usage")
    ep.base_url += "/nowhere"  # the stub answers 404 off /v1/completions
    rep = replay(ep, requests())
    assert len(rep.errors) == len(LENGTHS) and not rep.timings and not rep.token_check(requests())["ok"]


def _stub_spec(mode: str) -> ServerSpec:
    port = free_port()
    return ServerSpec(name="stub", cmd=[sys.executable, str(STUB), "--port", str(port), "--mode", mode],
                      base_url=f"http://127.0.0.1:{port}", ready_timeout_s=60)


def test_run_server_measures_a_server_process(tmp_path):
    spec = _stub_spec("usage")
    run = run_server("stub", spec, Endpoint(spec.base_url, "m"), requests(), tmp_path / "stub.log", {"version": "v1"})
    e = run.extra
    assert run.generated_tokens == sum(LENGTHS) and e["outputs_exact"] and e["version"] == "v1"
    assert e["target"] == "http" and str(STUB) in e["command"] and e["ready_s"] is not None
    # A Python process holds tens of MiB resident; the sampler read the server's tree, not nothing.
    assert e["peak_rss_bytes"] > 5 * 2**20 and e["rss_samples"] >= 2 and e["server_cpu_s"] >= 0
    assert 0 <= e["front_cpu_s"] <= e["server_cpu_s"] + 0.02  # the stub is one process: its front is all of it
    assert e["client_cpu_ms_per_token"] > 0  # parsing the streams took this process some CPU


class _BrokenPeer:
    """A peer whose server exits at once (as a missing library or a bad flag would make it)."""

    @staticmethod
    def install(job, log):
        return {"version": "broken 0"}

    @staticmethod
    def server_spec(job, installed, port):
        spec = ServerSpec(name="broken", cmd=[sys.executable, "-c", "import sys; print('no AVX here'); sys.exit(3)"],
                          base_url=f"http://127.0.0.1:{port}", ready_timeout_s=30)
        return spec, {}


def test_a_peer_that_does_not_start_is_unavailable_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setitem(http_peers.HTTP_PEERS, "broken", _BrokenPeer)
    monkeypatch.setitem(http_peers.PINNED, "broken", "broken==0")
    job = PeerJob("m", tmp_path, "float32", 1, 4, 64, 32)
    with pytest.raises(PeerUnavailable, match="exited with code 3"):
        run_http_peer("broken", job, requests(), tmp_path, log=lambda m: None)
    assert "no AVX here" in (tmp_path / "broken.log").read_text()


def _timed_run(name: str, scale: float, exact: bool = True) -> SystemRun:
    from gpuservd.bench.records import RequestTiming

    timings = [RequestTiming(r.request_id, r.cls, 0.0, 0.1 * scale, scale * (1 + i), 4, r.output_tokens)
               for i, r in enumerate(requests())]
    extra = {"target": "http", "peak_rss_mib": 100.0 * scale, "peak_rss_bytes": int(100 * scale * 2**20),
             "server_cpu_ms_per_token": 2.0, "front_cpu_ms_per_token": 0.3, "client_cpu_ms_per_token": 0.05, "version": f"{name} 1", "command": f"{name} --serve",
             "token_check": {"ok": exact, "expected": 28, "counted": 28 if exact else 20, "num_wrong_length": 0 if exact else 2,
                             "num_failed": 0}}
    return SystemRun(name, 4 * scale, timings, extra if name != "gpuserv" else {})


def test_report_shows_http_targets_ratios_skips_and_short_streams(tmp_path):
    runs = [_timed_run("gpuserv", 1.0), _timed_run("gpuserv[http]", 1.25), _timed_run("llama_server", 2.0),
            _timed_run("vllm_cpu", 2.5, exact=False)]
    result = write_report(tmp_path, None, runs, None, {}, skipped={"hf_vapour": "install failed: no wheel"})
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["skipped"] == {"hf_vapour": "install failed: no wheel"}
    assert saved["http_inprocess"]["throughput_ratio"] == pytest.approx(1 / 1.25)
    assert saved["ratios_http"]["llama_server"]["throughput"] == pytest.approx(2.0 / 1.25)
    assert "gpuserv[http]" not in saved["ratios"] and "llama_server" in saved["ratios"]
    assert saved["systems"]["llama_server"]["extra"]["peak_rss_mib"] == 200.0
    md = (tmp_path / "result.md").read_text()
    assert md == result_md(result)
    assert "- hf_vapour: SKIPPED: install failed: no wheel" in md
    assert "WARNING vllm_cpu: outputs not exactly the lengths asked" in md
    assert "WARNING llama_server" not in md
    assert "| llama_server | 3.5 |" in md and "| 200 | 2.00 | 0.300 | llama_server 1 |" in md
    assert "- gpuserv[http] / gpuserv in-process: 0.800x tok/s; the bench's client took 0.050 ms" in md
    assert saved["http_inprocess"]["http_client_cpu_ms_per_token"] == 0.05
    assert "the daemon's own process (its serving path, without an engine worker) 0.300 ms" in md
    assert saved["http_inprocess"]["http_daemon_cpu_ms_per_token"] == 0.3
    assert "- llama_server: `llama_server --serve`" in md


def result_md(result):
    from gpuservd.bench.report import markdown

    return markdown(result)


def test_peer_command_lines_match_gpuservs_run(tiny_model_dir, tmp_path, monkeypatch):
    from gpuservd.bench import llama_peer, vllm_peer

    job = PeerJob("tiny", tiny_model_dir, "float32", 2, 8, 512, 300)
    spec, settings = llama_peer.server_spec(job, {"binary": "/x/llama-server", "gguf": "/x/m.gguf"}, 1234)
    cmd = spec.cmd
    arg = lambda flag: cmd[cmd.index(flag) + 1]  # noqa: E731
    assert arg("-t") == arg("-tb") == "2" and arg("--parallel") == "8" and "--cont-batching" in cmd
    # Every slot holds the longest request (300 + 16 rounded up to 512 tokens).
    assert arg("--ctx-size") == str(8 * 512) and settings["ctx_per_slot"] == 512
    assert arg("--cache-type-k") == arg("--cache-type-v") == "f32" and spec.base_url == "http://127.0.0.1:1234"

    lib = tmp_path / "lib"
    lib.mkdir()
    assert vllm_peer.find_tcmalloc(dirs=[lib]) is None
    (lib / "libtcmalloc_minimal.so.4").write_bytes(b"")
    found = vllm_peer.find_tcmalloc(dirs=[lib])
    spec, settings = vllm_peer.server_spec(job, {"python": "/v/python", "tcmalloc": found, "iomp": "/v/libiomp5.so"}, 99)
    assert spec.env["LD_PRELOAD"] == f"{lib / 'libtcmalloc_minimal.so.4'}:/v/libiomp5.so"
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and spec.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    cmd = spec.cmd
    assert arg("--max-num-seqs") == "8" and arg("--dtype") == "float32" and arg("--max-model-len") == "512"
    spec, settings = vllm_peer.server_spec(job, {"python": "/v/python", "tcmalloc": None}, 99)
    assert "LD_PRELOAD" not in spec.env and "libgoogle-perftools4" in settings["tcmalloc"]


@pytest.mark.parametrize("args, message", [
    (("bench", "peers", "install", "nope"), "unknown peer nope; choose from llama_server, vllm_cpu"),
    (("bench", "-w", "profiles/workloads/smoke.yaml", "--isa", "sse2", "--peers", "none"), "GPUSERV_CPU_ISA='sse2'"),
    (("bench", "-w", "profiles/workloads/smoke.yaml", "--target", "gpu"), "inprocess, http or socket"),
])
def test_cli_mistakes_are_one_line(args, message, capsys, monkeypatch):
    from cli_invoke import invoke
    from gpuservd.runner import cpu_isa

    monkeypatch.setenv(cpu_isa.ENV, "native")  # restored after --isa wrote it
    assert invoke(*args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_bench_target_http_runs_gpuserv_through_its_own_daemon(store_home, tmp_path, capsys):
    """`--target http`: the in-process run and a private daemon's run, same requests, one report."""
    from cli_invoke import invoke

    wl = tmp_path / "wl.yaml"
    wl.write_text("name: tiny-http\nmodel: tiny\nseed: 1\nrequests: 5\narrival: {process: burst}\nclasses:\n"
                  "  - {name: short, share: 0.6, prompt_tokens: {dist: uniform, min: 4, max: 12}, "
                  "output_tokens: {dist: uniform, min: 2, max: 6}}\n"
                  "  - {name: long, share: 0.4, prompt_tokens: {dist: fixed, value: 8}, "
                  "output_tokens: {dist: fixed, value: 24}}\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("engine:\n  kv_cache_bytes: 4MiB\n  block_size: 4\n  num_threads: 1\n")
    out = tmp_path / "out"
    assert invoke("bench", "-w", str(wl), "--config", str(cfg), "--peers", "none", "--target", "http",
                  "--out", str(out)) == 0, capsys.readouterr().err
    result = json.loads((out / "result.json").read_text())
    inproc, http = result["systems"]["gpuserv"], result["systems"]["gpuserv[http]"]
    assert inproc["generated_tokens"] == http["generated_tokens"] > 0
    e = http["extra"]
    assert e["outputs_exact"] and e["transport"].startswith("unix:") and e["peak_rss_bytes"] > 0
    assert e["settings"]["engine"]["num_threads"] == 1 and e["settings"]["engine"]["kv_cache_bytes"] == "4MiB"
    assert result["http_inprocess"]["throughput_ratio"] > 0 and result["skipped"] == {}
    assert "gpuserv[http] / gpuserv in-process" in (out / "result.md").read_text()
    assert (out / "gpuservd.log").exists()

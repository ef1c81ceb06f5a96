"""docs/observability/ against a live daemon (a subprocess serving two models, TCP with a bearer token).

Every expression of the shipped Grafana dashboard names only metrics the daemon
exports; every panel of vLLM's own dashboard that the docs list as working finds
its metrics (and the one listed as not working does not); the scrape config is
well formed; `server.metrics_public` opens GET /metrics over TCP and nothing else.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from daemon_harness import ROOT, DaemonProcess, make_home, free_port

DOCS = ROOT / "docs" / "observability"
TOKEN = "obs-token"
# PromQL words an expression may hold besides metric names.
PROMQL = {"sum", "avg", "min", "max", "count", "by", "without", "rate", "irate", "increase", "histogram_quantile",
          "label_values", "and", "or", "unless", "on", "ignoring", "group_left", "group_right", "bool", "offset",
          "topk", "bottomk", "clamp_min", "clamp_max", "abs", "delta", "deriv", "time", "vector", "scalar"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("observability")
    (tmp / "token").write_text(TOKEN + "\n")
    port = free_port()
    d = DaemonProcess(tmp, make_home(tmp, tiny_model_dir, names=("tiny", "tiny2")), config={
        "server": {"models": ["tiny", "tiny2"], "tcp": f"127.0.0.1:{port}", "tcp_token_file": str(tmp / "token")}})
    d.url = f"http://127.0.0.1:{port}"
    try:
        d.wait_ready()
        with d.http() as c:
            for model in ("tiny", "tiny2"):
                r = c.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 3})
                assert r.status_code == 200, r.text
        yield d
    finally:
        d.stop(wait_exit=False)


@pytest.fixture(scope="module")
def exported(daemon) -> tuple[set[str], set[str]]:
    """(sample names, family names) of the daemon's /metrics."""
    with daemon.http() as c:
        fams = list(text_string_to_metric_families(c.get("/metrics").text))
    return {s.name for f in fams for s in f.samples}, {f.name for f in fams}


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: strings, label matchers, ranges and variables removed."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\w+", " ", expr)
    expr = re.sub(r"label_values\(([^,()]+),\s*\w+\)", r"\1", expr)  # its second argument is a label
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", " ", expr)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {w for w in words if w not in PROMQL and not re.fullmatch(r"\d+(\.\d+)?|e", w)}


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((DOCS / "gpuserv-fleet.json").read_text())
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    out += [(f"variable {v['name']}", v["query"]["query"]) for v in dash["templating"]["list"]
            if isinstance(v.get("query"), dict)]
    return out


def exports(name: str, samples: set[str], families: set[str]) -> bool:
    """A sample name the daemon serves now, or one of a family it declares (a counter with no series yet)."""
    if name in samples:
        return True
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in families:
            return True
    return False


def test_the_dashboard_reads_only_what_the_daemon_exports(exported):
    samples, families = exported
    exprs = dashboard_exprs()
    assert len(exprs) > 20
    for where, expr in exprs:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr}"
        missing = {n for n in names if not exports(n, samples, families)}
        assert not missing, f"{where}: {sorted(missing)} not in the daemon's /metrics ({expr})"


def vllm_panels() -> list[tuple[str, list[str], bool]]:
    """(panel, metric names, works) from the docs' table of vLLM's dashboard panels."""
    text = (DOCS / "README.md").read_text()
    table = text[text.index("| panel | metrics | works unchanged |"):].split("\n\n")[0]
    rows = []
    for line in table.splitlines()[2:]:
        panel, metrics, works = [c.strip() for c in line.strip("|").split("|")]
        rows.append((panel, re.findall(r"`([^`]+)`", metrics), works.startswith("yes")))
    return rows


def test_vllm_dashboard_panels_the_docs_list_as_working_find_their_metrics(exported):
    samples, families = exported
    rows = vllm_panels()
    assert len(rows) == 12 and sum(works for _, _, works in rows) == 11
    for panel, names, works in rows:
        found = [exports(n, samples, families) or n in families for n in names]
        assert all(found) if works else not any(found), (panel, dict(zip(names, found)))


def test_the_scrape_config_is_well_formed():
    cfg = yaml.safe_load((DOCS / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["gpuserv"]["metrics_path"] == "/metrics"
    targets = [t for sc in jobs["gpuserv"]["static_configs"] for t in sc["targets"]]
    assert len(targets) >= 2 and all(re.fullmatch(r"[\w.-]+:\d+", t) for t in targets)


def test_metrics_public_opens_metrics_over_tcp_and_nothing_else(daemon):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=daemon.url, timeout=10) as tcp, daemon.http() as unix:
        assert tcp.get("/metrics").status_code == 401  # off by default
        assert tcp.get("/metrics", headers=auth).status_code == 200
        try:
            daemon.write_config({**daemon.config, "server": {**daemon.config["server"], "metrics_public": True}})
            assert unix.post("/admin/reload").json()["reloaded"] is True
            r = tcp.get("/metrics")
            assert r.status_code == 200 and "vllm:num_requests_waiting" in r.text
            assert tcp.get("/v1/models").status_code == 401
            assert tcp.get("/admin/status").status_code == 403  # the admin routes: never without the admin token
            assert tcp.get("/v1/models", headers=auth).status_code == 200
        finally:
            daemon.write_config({**daemon.config, "server": {**daemon.config["server"], "metrics_public": False}})
            assert unix.post("/admin/reload").json()["reloaded"] is True
        assert tcp.get("/metrics").status_code == 401

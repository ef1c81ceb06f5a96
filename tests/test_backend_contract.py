"""The backend contract routers and endpoint pickers read, on the app in this process with two models.

/metrics parsed with prometheus_client's own parser: every family the inference
gateway's endpoint picker and vLLM's Grafana dashboards read is there with the
right type and labels; the first series of each picker family is the daemon's
total; request-level histograms mean what vLLM's mean; a model that unloads
takes its series with it while scrapes go on. Also: X-Request-Id kept end to
end, /v1/models root/parent, /health while draining.
"""

from __future__ import annotations

import asyncio
import logging
import time

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inprocess_app import run_in_app
from test_variants import derive

CONFIG = {"engine": {"kv_cache_bytes": "4MiB", "block_size": 4, "num_threads": 1}, "server": {"models": []},
          "cache": {"cache_size": 4}}
MAX_TOKENS = 5

# What the endpoint picker reads: family -> (type, labels of its FIRST series).
PICKER = {
    "vllm:num_requests_waiting": ("gauge", set()),
    "vllm:num_requests_running": ("gauge", set()),
    "vllm:kv_cache_usage_perc": ("gauge", set()),
    "vllm:gpu_cache_usage_perc": ("gauge", set()),
    "vllm:num_requests_swapped": ("gauge", set()),
    "vllm:cache_config_info": ("gauge", {"block_size", "num_gpu_blocks", "enable_prefix_caching"}),
    "vllm:lora_requests_info": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
}
# What vLLM's Grafana dashboards read, per model (parser family names: a counter's without _total).
DASHBOARD = {
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_swapped": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
}


@pytest.fixture()
def home(store_home):
    from gpuservd.store.store import ModelStore

    ModelStore().import_dir(store_home / "models" / "tiny", "tiny2")
    return store_home


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, name: str, **labels) -> float:
    """The sample `name` (a family's sample name, e.g. x_count) whose labels are exactly `labels`."""
    family = name.removesuffix("_count").removesuffix("_sum").removesuffix("_total").removesuffix("_bucket")
    hits = [s.value for s in fams[family].samples if s.name == name and s.labels == labels]
    assert len(hits) == 1, (name, labels, fams[family].samples)
    return hits[0]


async def complete(client, model: str, **extra):
    r = await client.post("/v1/completions", json={"model": model, "prompt": "the capital of", "ignore_eos": True,
                                                   "max_tokens": MAX_TOKENS, **extra})
    assert r.status_code == 200, r.text
    return r


def test_every_family_the_picker_and_dashboards_read(home):
    async def check(client, serving):
        for _ in range(3):
            await complete(client, "tiny")
        await complete(client, "tiny2")
        fams = families((await client.get("/metrics")).text)
        for name, (kind, first_labels) in PICKER.items():
            assert fams[name].type == kind, name
            assert set(fams[name].samples[0].labels) == first_labels, (name, fams[name].samples[0])
        for name, kind in DASHBOARD.items():
            assert fams[name].type == kind, name
            models = {s.labels.get("model_name") for s in fams[name].samples} - {None}
            assert models == {"tiny", "tiny2"}, (name, models)
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:num_requests_swapped",
                     "vllm:kv_cache_usage_perc"):
            per_model = [s for s in fams[name].samples[1:] if set(s.labels) == {"model_name"}]
            assert len(per_model) == 2 and len(fams[name].samples) == 3, name
        assert value(fams, "vllm:num_requests_waiting") == 0 and value(fams, "vllm:num_requests_running") == 0
        blocks = {n: s.loop.snapshot.kv_blocks_total for n, s in serving.slots.items()}
        first = fams["vllm:cache_config_info"].samples[0].labels
        assert first == {"block_size": "4", "num_gpu_blocks": str(sum(blocks.values())),
                         "enable_prefix_caching": "True"}
        for s in fams["vllm:cache_config_info"].samples[1:]:
            assert s.labels["num_gpu_blocks"] == str(blocks[s.labels["model_name"]])
        # Request-level histograms mean what vLLM's mean, per request.
        n = 3
        assert value(fams, "vllm:request_success_total", model_name="tiny", finished_reason="length") == n
        assert value(fams, "vllm:request_generation_tokens_sum", model_name="tiny") == n * MAX_TOKENS
        assert value(fams, "vllm:request_prompt_tokens_count", model_name="tiny") == n
        per_token = n * (MAX_TOKENS - 1)  # one gap per token after the first
        assert value(fams, "vllm:time_per_output_token_seconds_count", model_name="tiny") == per_token
        assert value(fams, "vllm:inter_token_latency_seconds_count", model_name="tiny") == per_token
        assert value(fams, "vllm:request_time_per_output_token_seconds_count", model_name="tiny") == n
        decode = value(fams, "vllm:request_decode_time_seconds_sum", model_name="tiny")
        assert value(fams, "vllm:request_time_per_output_token_seconds_sum", model_name="tiny") == \
            pytest.approx(decode / (MAX_TOKENS - 1))
        phases = sum(value(fams, f"vllm:request_{p}_time_seconds_sum", model_name="tiny")
                     for p in ("queue", "prefill", "decode"))
        assert phases == pytest.approx(value(fams, "vllm:e2e_request_latency_seconds_sum", model_name="tiny"))
        assert value(fams, "vllm:request_inference_time_seconds_sum", model_name="tiny") == pytest.approx(
            phases - value(fams, "vllm:request_queue_time_seconds_sum", model_name="tiny"))

    run_in_app(check, CONFIG, load=["tiny", "tiny2"])


def test_fast_exposition_parses_to_what_prometheus_client_renders(home):
    async def check(client, serving):
        await complete(client, "tiny")
        await complete(client, "tiny2", stream=True)
        ours = families(serving.metrics.render().decode())
        ref = families(prometheus_client.generate_latest(serving.metrics.registry).decode())
        assert set(ours) == set(ref)
        typed = {m._name for m in serving.metrics.exposition.metrics}
        assert typed and typed <= set(ref)
        for name, fam in ref.items():
            assert ours[name].type == fam.type and ours[name].documentation == fam.documentation, name
            if name in typed:  # no request runs now: the engine-fed series are equal, value for value
                assert ours[name].samples == fam.samples, name
            else:  # clocks move between two renders: the gauges read at scrape time
                assert [(s.name, s.labels) for s in ours[name].samples] == [(s.name, s.labels) for s in fam.samples]

    run_in_app(check, CONFIG, load=["tiny", "tiny2"])


def test_metrics_says_its_render_time_in_server_timing(home):
    """A scraper splits a slow scrape into the render and the wait around it (scripts/bench_metrics_scrape.py)."""
    async def check(client, serving):
        await complete(client, "tiny")
        r = await client.get("/metrics")
        assert r.status_code == 200
        parts = dict(item.strip().split(";dur=") for item in r.headers["server-timing"].split(","))
        assert set(parts) == {"render", "render-cpu"}, r.headers["server-timing"]
        assert all(float(v) >= 0 for v in parts.values()), parts
        assert families(r.text)["vllm:num_requests_running"]  # the body is the exposition, as before

    run_in_app(check, CONFIG, load=["tiny", "tiny2"])


def test_the_sharing_rows_metrics_reads_are_what_the_status_shows(home):
    """/metrics reads the arbiter's counters and the quotas through SharingManager.metric_rows(), not the
    whole status: the same numbers."""
    async def check(client, serving):
        await complete(client, "tiny")
        await complete(client, "tiny2")
        rows, st = serving.sharing.metric_rows(), serving.sharing.status()
        assert rows["arbiter"]["enabled"] == st["arbiter"]["enabled"]
        if st["arbiter"]["enabled"]:
            assert set(rows["arbiter"]["models"]) == set(st["arbiter"]["models"]) == {"tiny", "tiny2"}
            for name, x in rows["arbiter"]["models"].items():
                full = st["arbiter"]["models"][name]
                assert {k: full[k] for k in ("run_s", "wait_s", "num_slices", "duty")} == \
                    {k: x[k] for k in ("run_s", "wait_s", "num_slices", "duty")}, name
                assert x["usage"] == pytest.approx(full["usage"], abs=0.01)  # decays between the two reads
            assert rows["arbiter"]["switch_s"] == st["arbiter"]["switch_s"]
        assert {n: (q["quota"], q.get("used_bytes")) for n, q in st["quotas"].items()} == \
            {n: (q["quota"], q["used_bytes"]) for n, q in rows["quotas"].items()}
        assert rows["quotas"] and all(q["used_bytes"] for q in rows["quotas"].values())

    run_in_app(check, CONFIG, load=["tiny", "tiny2"])


def test_the_weight_cache_counters_metrics_reads_are_what_the_status_shows(home):
    async def check(client, serving):
        await complete(client, "tiny")
        await complete(client, "tiny2")
        counters, st = serving.models.cache.counters(), serving.models.cache.status()
        assert counters["hits"] == st["hits"] and counters["misses"] == st["misses"]
        assert counters["used_bytes"] == {t: st[t]["used_bytes"] for t in ("device", "host")}
        assert counters["used_bytes"]["device"] > 0
        fams = families((await client.get("/metrics")).text)
        assert value(fams, "gpuserv_weight_cache_bytes", tier="device") == counters["used_bytes"]["device"]

    run_in_app(check, CONFIG, load=["tiny", "tiny2"])


def test_requests_waiting_for_their_model_load_count_as_waiting(home):
    gate = asyncio.Event()

    def prepare(serving):
        make_room = serving.models._make_room

        async def held(name, *args):
            if name == "tiny2":
                await gate.wait()
            return await make_room(name, *args)

        serving.models._make_room = held

    async def check(client, serving):
        asks = [asyncio.ensure_future(complete(client, "tiny2")) for _ in range(2)]
        deadline = time.monotonic() + 30
        while serving.models.load_waiters.get("tiny2", 0) < 2:
            assert time.monotonic() < deadline, "the requests never waited for the load"
            await asyncio.sleep(0.01)
        fams = families((await client.get("/metrics")).text)
        assert value(fams, "vllm:num_requests_waiting") == 2  # the daemon's total, the picker's first series
        assert value(fams, "vllm:num_requests_waiting", model_name="tiny2") == 2
        assert value(fams, "vllm:num_requests_waiting", model_name="tiny") == 0
        gate.set()
        for a in asks:
            await a
        fams = families((await client.get("/metrics")).text)
        assert value(fams, "vllm:num_requests_waiting") == 0 and not serving.models.load_waiters

    run_in_app(check, CONFIG, load=["tiny"], prepare=prepare)


def test_scrapes_during_loads_and_unloads_never_fail_and_leave_no_stale_model(home):
    async def check(client, serving):
        scrapes: list[dict] = []
        stop = asyncio.Event()

        async def scrape():
            while not stop.is_set():
                r = await client.get("/metrics")
                assert r.status_code == 200
                scrapes.append(families(r.text))  # parses: a torn or malformed text raises here
                await asyncio.sleep(0.005)

        scraper = asyncio.ensure_future(scrape())
        for _ in range(3):
            await complete(client, "tiny2")  # loads on demand
            assert (await client.post("/admin/models/tiny2/unload")).status_code == 200
        await asyncio.sleep(0.05)
        stop.set()
        await scraper
        seen = [f for f in scrapes if any(s.labels.get("model_name") == "tiny2"
                                          for fam in f.values() for s in fam.samples)]
        assert len(scrapes) > 10 and seen, "the scrapes never saw tiny2 while it was loaded"
        last = families((await client.get("/metrics")).text)
        stale = [(fam.name, s.labels) for fam in last.values() for s in fam.samples
                 if s.labels.get("model_name") == "tiny2"]
        assert not stale, stale[:5]
        assert value(last, "vllm:request_success_total", model_name="tiny", finished_reason="length") == 1
        await complete(client, "tiny2")  # back again: its series start again from zero
        again = families((await client.get("/metrics")).text)
        assert value(again, "vllm:request_success_total", model_name="tiny2", finished_reason="length") == 1

    async def with_tiny(client, serving):
        await complete(client, "tiny")
        await check(client, serving)

    run_in_app(with_tiny, CONFIG, load=["tiny"])


def test_variants_in_models_and_in_lora_requests_info(home):
    derive(home, "tiny-lora")

    async def check(client, serving):
        await complete(client, "tiny-lora")
        await complete(client, "tiny")
        cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert (cards["tiny"]["root"], cards["tiny"]["parent"]) == ("tiny", None)
        assert (cards["tiny-lora"]["root"], cards["tiny-lora"]["parent"]) == ("tiny-lora", "tiny")
        assert (await client.get("/v1/models/tiny-lora")).json()["parent"] == "tiny"
        fams = families((await client.get("/metrics")).text)
        (info,) = fams["vllm:lora_requests_info"].samples
        assert info.labels == {"max_lora": "4", "running_lora_adapters": "tiny-lora", "waiting_lora_adapters": ""}
        assert abs(info.value - time.time()) < 60  # the picker takes the series with the latest time

    run_in_app(check, CONFIG)


def test_x_request_id_is_kept_end_to_end(home, caplog):
    async def check(client, serving):
        rid = "gw-7f3a:trace/42"
        r = await complete(client, "tiny")
        assert r.headers["x-request-id"] == r.json()["id"]  # without one: the daemon's own
        r = await client.post("/v1/chat/completions", headers={"X-Request-Id": rid},
                              json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-request-id"] == rid and r.json()["id"] == rid
        finished = [e for e in serving.bus.recent_events if e["type"] == "request_finished"]
        assert finished[-1]["request_id"] == rid
        assert any(rid in rec.getMessage() for rec in caplog.records if rec.name == "gpuservd.access")
        r = await client.post("/v1/completions", headers={"X-Request-Id": "has space"},
                              json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
        # One id names one request at a time.
        long = asyncio.ensure_future(client.post("/v1/completions", headers={"X-Request-Id": "dup-1"}, json={
            "model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": True}))
        deadline = time.monotonic() + 30
        while "dup-1" not in serving.active:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        r = await client.post("/v1/completions", headers={"X-Request-Id": "dup-1"},
                              json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_request_id"
        first = await long
        assert first.status_code == 200 and first.json()["id"] == "dup-1"
        r = await client.post("/v1/completions", headers={"X-Request-Id": "dup-1"},
                              json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200  # free again once the first ended

    caplog.set_level(logging.INFO, logger="gpuservd.access")
    run_in_app(check, CONFIG, load=["tiny"])


def test_health_answers_503_while_draining(home):
    async def check(client, serving):
        assert (await client.get("/health")).status_code == 200
        serving.state = "draining"
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "draining"
        assert (await client.get("/ready")).status_code == 503
        serving.resume()
        assert (await client.get("/health")).status_code == 200

    run_in_app(check, CONFIG, load=["tiny"])

"""Engine worker processes without the daemon's socket (Serving in-process, or a WorkerLoop alone): under the
mps backend each model's worker starts with its MPS settings in its real environment (/proc/<pid>/environ),
computed from its plan; what cannot cross a process boundary is refused with a clear error; a worker that
will not stop gets SIGTERM, then SIGKILL, and is reaped; the config names the choices.

MPS detection is injected (there is no GPU here): these tests check the environment the workers get and
the status that reports it, never that SMs were partitioned.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from gpuservd.serving.daemon_config import daemon_config_from_dict
from gpuservd.errors import UserError
from inprocess_app import run_in_app

BODY = {"prompt": "the capital", "max_tokens": 6, "ignore_eos": True, "temperature": 0}
ENGINE = {"kv_cache_bytes": "4MiB", "block_size": 4, "num_threads": 1}


@pytest.fixture()
def two_models(store_home, tiny_model_dir):
    from gpuservd.store.store import ModelStore

    ModelStore().import_dir(tiny_model_dir, "tiny2")
    return store_home


def environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_mps_workers_start_with_their_plans_sm_percentage_and_memory_limit(two_models, tmp_path):
    from gpuservd.gpu.backends import choose_backend
    from gpuservd.gpu.mps import MpsDaemon

    pipe = str(tmp_path / "mps-pipe")

    def inject(serving):  # an MPS control daemon "found", and CUDA "usable": injected, not real
        serving.sharing.backend = choose_backend("mps", "cpu", mps=lambda: MpsDaemon(True, pipe, "injected by a test"),
                                                 cuda_check=lambda device: None)

    async def check(client, serving):
        r = await client.post("/v1/completions", json={**BODY, "model": "tiny2"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        st = (await client.get("/admin/status")).json()
        models = {m["name"]: m for m in st["models"]}
        groups = {g["name"]: g for g in st["partitions"]["groups"]}
        assert st["partitions"]["backend"] == "mps" and st["partitions"]["hardware"]["num_sms"] == 108
        pids = set()
        for name, share in (("tiny", 0.6), ("tiny2", 0.4)):
            m = models[name]
            assert m["isolation"] == "process" and m["state"] == "ready"
            num_sms = groups[name]["num_sms"]
            assert m["num_sms"] == num_sms and num_sms >= share * 108 - 8  # the plan's SM group
            env = environ(m["worker_pid"])
            quota = st["quotas"][name]["quota"]
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(math.ceil(100 * num_sms / 108 - 1e-9))
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={math.ceil(quota / 2**20)}M"
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe
            assert "NOTIFY_SOCKET" not in env  # the daemon's systemd socket stays with the daemon
            assert m["worker_env"] == {k: v for k, v in env.items() if k.startswith("CUDA_MPS_")}
            pids.add(m["worker_pid"])
        assert len(pids) == 2
        summary = st["partitions"]["summary"]
        assert summary.startswith("SM partitions: MPS on the device, one engine worker process per model (")
        assert f"tiny {models['tiny']['worker_env']['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}% pid " \
               f"{models['tiny']['worker_pid']}" in summary
        assert st["sharing"]["workers"]["tiny2"]["pid"] == models["tiny2"]["worker_pid"]
        # what cannot cross the process boundary is refused, not approximated
        loop = serving.slots["tiny"].loop
        with pytest.raises(TypeError, match="engine worker process .*module-level function"):
            loop.call(lambda engine: engine.requests).result(5)
        with pytest.raises(UserError, match="arbiter's time slices pace engine threads of the daemon only"):
            loop.set_arbiter(object())
        await serving.unload("tiny2")
        st = (await client.get("/admin/status")).json()
        assert "tiny2" not in st["sharing"]["workers"] and "tiny2" not in st["partitions"]["summary"]

    run_in_app(check, {"engine": ENGINE, "server": {"models": ["tiny", "tiny2"]},
                       "sharing": {"hardware": "a100", "models": {"tiny": {"share": 0.6}, "tiny2": {"share": 0.4}}}},
               load=["tiny", "tiny2"], prepare=inject)


def test_a_variant_is_refused_in_a_worker_process(store_home):
    from test_variants import derive

    derive(store_home, "tiny-lora")

    async def check(client, serving):
        r = await client.post("/admin/models/tiny-lora/load")
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "tiny-lora is a variant of tiny" in msg and "engine.isolation: thread" in msg
        assert serving.slots["tiny-lora"].state == "failed" and "tiny-lora" not in serving.sharing.isolated

    run_in_app(check, {"engine": {**ENGINE, "isolation": "process"}, "server": {"models": []}})


def test_auto_isolation_puts_a_cpu_model_in_a_worker_and_its_variant_on_a_thread(store_home):
    """The default, engine.isolation: auto, on a CPU: the base model's engine runs in a worker process (it
    serves, its pid is a live child of this process), and a variant, which runs on its base's weights in the
    daemon's memory, gets an engine thread instead of the error an explicit `process` gives it."""
    from test_variants import derive

    derive(store_home, "tiny-lora")

    async def check(client, serving):
        for name in ("tiny", "tiny-lora"):
            r = await client.post("/v1/completions", json={**BODY, "model": name})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
        models = {m["name"]: m for m in (await client.get("/admin/status")).json()["models"]}
        assert models["tiny"]["isolation"] == "process" and models["tiny"]["state"] == "ready"
        assert environ(models["tiny"]["worker_pid"])  # a live process of ours
        assert models["tiny-lora"]["isolation"] == "thread" and models["tiny-lora"]["worker_pid"] is None
        assert list(serving.sharing.isolated) == ["tiny"]

    run_in_app(check, {"engine": {**ENGINE, "isolation": "auto"}, "server": {"models": []}})


def test_a_load_takes_the_spare_worker_started_ahead_and_a_new_one_waits_after_unload(store_home):
    """A worker started ahead (worker/spare.py) is what the next worker load runs in: the model's worker pid
    is the spare's, started before the load. Once the model leaves, another spare waits, and the next load
    takes that one. Stopping the engines ends and reaps the spare. Engine threads get no spare."""
    import time
    from pathlib import Path

    seen: dict = {}

    def first_spare(serving):
        seen["spare"] = serving.models.spare.pid

    async def check(client, serving):
        models = serving.models
        r = await client.post("/v1/completions", json={**BODY, "model": "tiny"})
        assert r.status_code == 200, r.text
        assert models.slots["tiny"].loop.pid == seen["spare"] and models.spare.pid is None
        await serving.unload("tiny")
        deadline = time.monotonic() + 30
        while models.spare.pid is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        spare = models.spare.pid
        assert spare is not None and spare != seen["spare"] and environ(spare)
        r = await client.post("/v1/completions", json={**BODY, "model": "tiny"})
        assert r.status_code == 200 and models.slots["tiny"].loop.pid == spare
        await serving.unload("tiny")
        while models.spare.pid is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        seen["last"] = models.spare.pid

    run_in_app(check, {"engine": {**ENGINE, "isolation": "auto"}, "server": {"models": []}}, prepare=first_spare)
    assert seen["spare"] and seen["last"] and not Path(f"/proc/{seen['last']}").exists()  # ended and reaped

    async def no_spare(client, serving):
        assert serving.models.spare is None

    run_in_app(no_spare, {"engine": {**ENGINE, "isolation": "thread"}, "server": {"models": []}})


def test_auto_isolation_keeps_engine_threads_where_the_arbiter_is_asked_for(two_models):
    """With shares or classes in sharing.models the arbiter has something to enforce, and it paces engine
    threads only: auto then keeps every model on a thread, time-sliced as configured."""
    async def check(client, serving):
        r = await client.post("/v1/completions", json={**BODY, "model": "tiny2"})
        assert r.status_code == 200
        st = (await client.get("/admin/status")).json()
        assert {m["name"]: m["isolation"] for m in st["models"]} == {"tiny": "thread", "tiny2": "thread"}
        assert not serving.sharing.isolated

    run_in_app(check, {"engine": {**ENGINE, "isolation": "auto"}, "server": {"models": ["tiny", "tiny2"]},
                       "sharing": {"models": {"tiny": {"share": 0.6, "class": "latency_critical"},
                                              "tiny2": {"share": 0.4}}}}, load=["tiny", "tiny2"])


def test_isolation_setting_names_its_choices():
    assert daemon_config_from_dict({"engine": {"isolation": "process"}}).engine.isolation == "process"
    assert daemon_config_from_dict({}).engine.isolation == "auto"
    with pytest.raises(UserError, match="engine.isolation must be one of auto, thread, process, got 'fork'"):
        daemon_config_from_dict({"engine": {"isolation": "fork"}})


def test_a_worker_that_does_not_stop_gets_sigterm_then_sigkill(store_home, monkeypatch):
    """stop(): the stop message, then SIGTERM, then SIGKILL; the process is reaped either way. A stopped
    (SIGSTOP) worker reads no message and SIGTERM stays pending on it, so only SIGKILL ends it."""
    import asyncio
    import os
    import signal

    from gpuservd.config import EngineConfig
    from gpuservd.engine.calls import request_views
    from gpuservd.store.store import ModelStore
    from gpuservd.worker import proxy
    from gpuservd.worker.build import WorkerSpec
    from gpuservd.worker.proxy import WorkerLoop

    monkeypatch.setattr(proxy, "KILL_AFTER_S", 0.5)
    path = str(ModelStore().path("tiny"))
    spec = WorkerSpec("tiny", path, path, EngineConfig(kv_cache_bytes=4 * 2**20, block_size=4, num_threads=1))
    died = []

    async def main():
        loop = WorkerLoop("tiny", spec, asyncio.get_running_loop(), lambda d, e: None,
                          on_death=lambda lp, info: died.append(info))
        loop.start()
        facts = await asyncio.wrap_future(loop.ready)
        assert facts.num_kv_blocks > 0 and facts.source_tier == "disk" and loop.alive
        os.kill(loop.pid, signal.SIGSTOP)
        await asyncio.to_thread(loop.stop, 0.5)
        assert not loop.alive and loop.exit["signal"] == signal.SIGKILL
        assert loop.exit["reason"] == "killed by signal 9 (SIGKILL)"
        assert not os.path.exists(f"/proc/{loop.pid}")  # reaped
        with pytest.raises(RuntimeError, match="engine worker exited"):
            loop.call(request_views).result(1)
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert died == []  # asked to stop: not a death

"""SM-partition backends, the green-context adapter across torch's API shapes, the driver split and MPS.

This machine has no CUDA: the real paths must say so. The CUDA paths run against stand-ins shaped like
each torch release's GreenContext and like cuda.bindings.driver; they test our version handling, state
and bookkeeping, not the hardware (scripts/gpu_check.py does that on a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gpuservd.errors import UserError
from gpuservd.gpu import green_driver
from gpuservd.gpu.backends import GreenContextBackend, MpsBackend, NoPartitions, choose_backend
from gpuservd.gpu.green import GreenAdapter, describe_api
from gpuservd.gpu.mps import MpsDaemon, active_thread_percentage, detect_mps, worker_env

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA_LINE = "SM partitions: not enforced (no CUDA device)"


# ---- this machine ------------------------------------------------------------------------------------
# These ask the real torch: on a CPU machine (CI) "cuda:0" is not there; on a GPU machine it is, and the
# same tests check what the machine offers instead, so `make test` passes (and means something) on both.
HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_auto_backend_on_this_machine(device):
    b = choose_backend("auto", device)
    if device == "cpu" or not HAS_CUDA:
        assert isinstance(b, NoPartitions) and b.name == "none" and not b.enforced
        assert b.status()["summary"] == NO_CUDA_LINE
        assert choose_backend("none", device).status()["summary"] == NO_CUDA_LINE
        assert b.bind("chat", 40) is None and b.prepare({"chat": 40}) == {}
        return
    # A GPU: auto takes green contexts where this torch and driver have them, else MPS if its daemon
    # runs, else none, and says which in one line; sharing.backend none never enforces anything.
    summary = b.status()["summary"]
    assert b.name in ("green_context", "mps", "none") and summary.startswith("SM partitions: ")
    assert b.enforced == (b.name != "none")
    if b.name == "none":
        assert "green contexts: " in summary and "MPS: " in summary  # why neither could be used
    none = choose_backend("none", device)
    assert isinstance(none, NoPartitions) and none.status()["summary"] == "SM partitions: not enforced " \
        "(sharing.backend: none)"
    b.close() if hasattr(b, "close") else None


@pytest.mark.parametrize("requested", ["green_context", "mps"])
def test_explicit_backend_without_cuda_is_a_user_error(requested):
    with pytest.raises(UserError) as err:
        choose_backend(requested, "cpu")
    assert f"sharing.backend {requested} is not available on cpu: no CUDA device" in str(err.value)


def test_real_green_adapter_says_why_here():
    ok, why = GreenAdapter().available(0, probe=True)
    if HAS_CUDA:
        assert why  # says what it found (the torch API in use) or why it cannot
        return
    assert not ok and why  # a CPU build of torch: says so, creates nothing
    with pytest.raises(RuntimeError, match="green contexts unavailable"):
        GreenAdapter().create(8, 0)


@pytest.mark.skipif(HAS_CUDA, reason="a GPU machine: scripts/gpu_check.py measures there (device_run.sh check)")
def test_gpu_check_without_cuda_exits_zero_and_writes_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--results-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "no CUDA device" in p.stdout and "nothing written" in p.stdout
    assert list(tmp_path.iterdir()) == []


# ---- stand-ins: torch.cuda and each shape of GreenContext -----------------------------------------------
class FakeStream:
    count = 0

    def __init__(self, name=""):
        FakeStream.count += 1
        self.name = name or f"s{FakeStream.count}"
        self.waited: list = []

    def wait_event(self, event):
        self.waited.append(event.stream)


class FakeEvent:
    def __init__(self):
        self.stream = None

    def record(self, stream=None):
        self.stream = stream


class FakeCuda:
    """torch.cuda's per-thread current stream, events, device facts, ExternalStream."""

    def __init__(self, num_sms=132, available=True):
        self.num_sms, self._available = num_sms, available
        self.default = FakeStream("default")
        self._local = threading.local()

    def is_available(self):
        return self._available

    def device_count(self):
        return 1 if self._available else 0

    def get_device_properties(self, i):
        return SimpleNamespace(multi_processor_count=self.num_sms)

    def current_stream(self, device=None):
        return getattr(self._local, "stream", self.default)

    def set_stream(self, s):
        self._local.stream = s

    Event = FakeEvent

    def ExternalStream(self, ptr, device=None):  # noqa: N802
        return FakeStream(f"ext{ptr}")


class GC29:
    """torch 2.9: create(num_sms, device_id=0), make_current()/pop_current(), no Stream()."""

    log: list = []

    @staticmethod
    def create(num_sms, device_id=0):
        GC29.log.append(("create", num_sms, device_id))
        return GC29()

    def make_current(self):
        GC29.log.append("make_current")

    def pop_current(self):
        GC29.log.append("pop_current")


class GC210:
    """torch 2.10-2.12: create(num_sms, device_id=0), set_context()/pop_context(), Stream()."""

    log: list = []

    @staticmethod
    def create(num_sms, device_id=0):
        GC210.log.append(("create", num_sms, device_id))
        return GC210()

    def set_context(self):
        GC210.log.append("set_context")

    def pop_context(self):
        GC210.log.append("pop_context")

    def Stream(self):  # noqa: N802
        return FakeStream("gc210")


class GC213:
    """torch 2.13: keyword-only create with workqueue_scope; set_context()/pop_context(); Stream()."""

    log: list = []
    refuse_workqueue = False

    @staticmethod
    def create(*, num_sms=None, workqueue_scope=None, workqueue_concurrency_limit=None, device_id=None):
        if workqueue_scope and GC213.refuse_workqueue:
            raise RuntimeError("cuda driver too old to use workqueue configuration!")
        GC213.log.append(("create", num_sms, workqueue_scope, device_id))
        return GC213()

    def set_context(self):
        GC213.log.append("set_context")

    def pop_context(self):
        GC213.log.append("pop_context")

    def Stream(self):  # noqa: N802
        return FakeStream("gc213")


class GCMain:
    """pytorch main after 2.13: a constructor, GreenContext.split (disjoint), Stream() per call, sm_count."""

    log: list = []

    def __init__(self, *, num_sms=None, sm_partition=None, workqueue_scope=None, workqueue_concurrency_limit=None,
                 device_id=None):
        self.sm_count = num_sms
        self.device_id = device_id

    @staticmethod
    def split(*, num_sms=0, coscheduled_sm_count=0, preferred_coscheduled_sm_count=0, backfill=False,
              workqueue_scope=None, workqueue_concurrency_limit=None, device_id=None):
        GCMain.log.append(("split", tuple(num_sms), workqueue_scope))
        return tuple(GCMain(num_sms=n, device_id=device_id) for n in num_sms)

    @staticmethod
    def create(*, num_sms=None, sm_partition=None, workqueue_scope=None, workqueue_concurrency_limit=None,
               device_id=None):
        GCMain.log.append(("create", num_sms, workqueue_scope))
        return GCMain(num_sms=num_sms, device_id=device_id)

    def Stream(self):  # noqa: N802
        return FakeStream("main")

    def set_context(self):
        raise AssertionError("deprecated: the adapter must use the stream")


class NoSig:
    __signature__ = "not a signature"  # inspect.signature raises, as for a C function

    def __call__(self, num_sms, device_id=0):
        return GC210()


class GCBuiltin(GC210):
    create = staticmethod(NoSig())


def test_api_shapes():
    assert describe_api(GC29) .__dict__ == {"shape": "create_positional", "enter": "make_current",
                                            "workqueue": False, "has_stream": False}
    assert describe_api(GC210).__dict__ == {"shape": "create_positional", "enter": "set_context",
                                            "workqueue": False, "has_stream": True}
    assert describe_api(GC213).__dict__ == {"shape": "create_kw", "enter": "set_context", "workqueue": True,
                                            "has_stream": True}
    assert describe_api(GCMain).__dict__ == {"shape": "constructor", "enter": "stream", "workqueue": True,
                                             "has_stream": True}
    assert describe_api(GCBuiltin).shape == "create_positional"
    assert "neither" in describe_api(type("X", (), {"create": staticmethod(lambda n: None)}))


def adapter(cls, **kw) -> GreenAdapter:
    return GreenAdapter(cls=cls, cuda=kw.pop("cuda", FakeCuda()), torch_version="2.x", **kw)


def test_create_passes_balanced_where_offered():
    GC213.log.clear()
    GC213.refuse_workqueue = False
    h = adapter(GC213).create(40, 0)
    assert GC213.log == [("create", 40, "balanced", 0)] and h.workqueue_scope == "balanced" and not h.note
    GC210.log.clear()
    h = adapter(GC210).create(40, 0)
    assert GC210.log == [("create", 40, 0)] and h.workqueue_scope is None and "not offered" in h.note


def test_create_without_workqueue_when_the_driver_refuses():
    GC213.log.clear()
    GC213.refuse_workqueue = True
    try:
        h = adapter(GC213).create(24, 0)
    finally:
        GC213.refuse_workqueue = False
    assert GC213.log == [("create", 24, None, 0)] and h.workqueue_scope is None
    assert "refused" in h.note and "too old" in h.note


@pytest.mark.parametrize("cls,push,pop", [(GC29, "make_current", "pop_current"),
                                          (GC210, "set_context", "pop_context"),
                                          (GC213, "set_context", "pop_context")])
def test_enter_exit_through_the_context_stack(cls, push, pop):
    cls.log.clear()
    h = adapter(cls).create(16, 0)
    with h:
        assert h.entered and cls.log[-1] == push
        with pytest.raises(RuntimeError, match="already entered"):
            h.enter()
    assert not h.entered and cls.log[-1] == pop


def test_enter_exit_through_the_stream_and_thread_checks():
    cuda = FakeCuda()
    h = adapter(GCMain, cuda=cuda).create(40, 0)
    before = cuda.current_stream()
    h.enter()
    assert cuda.current_stream() is h.stream and h.stream.waited == [before]  # queued work first
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, h.exit)))
    t.start()
    t.join()
    assert errors and "another thread" in str(errors[0].value)
    h.exit()
    assert cuda.current_stream() is before and before.waited == [h.stream]
    assert h.actual_num_sms == 40


def test_available_reasons():
    assert GreenAdapter(cls=GC213, cuda=FakeCuda(), torch_version="2.13.0+cpu", cuda_version=None).available() \
        == (False, "torch 2.13.0+cpu is a CPU build")
    assert "built without" in GreenAdapter(cls=GC213, cuda=FakeCuda(), torch_version="2.13", supported=False
                                           ).available()[1]
    assert adapter(GC213, cuda=FakeCuda(available=False)).available(0) == (False, "no CUDA device")
    ok, what = adapter(GC213).available(0, probe=True)
    assert ok and "API create_kw" in what and "workqueue_scope offered" in what

    class Broken(GC213):
        @staticmethod
        def create(*, num_sms=None, workqueue_scope=None, workqueue_concurrency_limit=None, device_id=None):
            raise RuntimeError("CUDA error: operation not supported")

    ok, what = adapter(Broken).available(0, probe=True)
    assert not ok and "creation failed" in what and "not supported" in what


# ---- the driver split (a stand-in of cuda.bindings.driver) ----------------------------------------------
class Res:
    def __init__(self, sms):
        self.sms = list(sms)
        self.sm = SimpleNamespace(smCount=len(self.sms))


class FakeDriver:
    """cuDevSmResourceSplitByCount rounds up to 8 SMs and takes the lowest ids, as a Hopper would."""

    CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM=1)
    CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM=1)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)

    def __init__(self, num_sms=132):
        self.num_sms = num_sms
        self.live: set = set()
        self.destroyed: list = []
        self.next_id = 100

    def cuGetErrorString(self, err):
        return 0, b"CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION"

    def cuInit(self, flags):
        return (0,)

    def cuDeviceGet(self, i):
        return 0, i

    def cuDeviceGetDevResource(self, dev, kind):
        return 0, Res(range(self.num_sms))

    def cuDevSmResourceSplitByCount(self, nb, res, flags, min_count):
        n = -(-min_count // 8) * 8
        if n > len(res.sms):
            return 914, [], 0, res  # the driver's error
        return 0, [Res(res.sms[:n])], 1, Res(res.sms[n:])

    def cuDevResourceGenerateDesc(self, resources, n):
        return 0, resources[0]

    def cuGreenCtxCreate(self, desc, dev, flags):
        self.next_id += 1
        ctx = SimpleNamespace(id=self.next_id, sms=desc.sms)
        self.live.add(ctx.id)
        return 0, ctx

    def cuGreenCtxGetDevResource(self, ctx, kind):
        return 0, Res(ctx.sms)

    def cuGreenCtxStreamCreate(self, ctx, flags, prio):
        self.next_id += 1
        return 0, self.next_id

    def cuStreamDestroy(self, s):
        return (0,)

    def cuGreenCtxDestroy(self, ctx):
        self.live.discard(ctx.id)
        self.destroyed.append(ctx.id)
        return (0,)


def test_driver_split_is_disjoint_and_rounds_to_the_granule():
    drv = FakeDriver()
    parts = green_driver.split([40, 40, 20], 0, drv=drv, cuda=FakeCuda())
    assert [p.sm_count for p in parts] == [40, 40, 24]  # 20 -> 24: the driver's 8-SM granule
    sets = [set(p.green_ctx.sms) for p in parts]
    assert not (sets[0] & sets[1]) and not (sets[1] & sets[2]) and not (sets[0] & sets[2])
    assert parts[0].Stream().name.startswith("ext")
    assert len(drv.live) == 5  # three partitions and the two remainders they were split from
    for p in parts:
        p.close()
    assert drv.live == set()  # the remainders go with the last partition


def test_driver_split_that_does_not_fit_cleans_up():
    drv = FakeDriver()
    with pytest.raises(RuntimeError, match="partition 2: 64 SMs asked, 52 left"):
        green_driver.split([40, 40, 64], 0, drv=drv, cuda=FakeCuda())
    assert drv.live == set()
    drv = FakeDriver(num_sms=12)
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION"):
        green_driver.split([12], 0, drv=drv, cuda=FakeCuda())  # 12 -> 16 > 12: the driver says no


# ---- backends on a (stand-in) CUDA device ---------------------------------------------------------------
def no_mps():
    return MpsDaemon(False, "/tmp/nvidia-mps", "no MPS control daemon")


def with_mps():
    return MpsDaemon(True, "/tmp/nvidia-mps", "control pipe /tmp/nvidia-mps/control")


def cuda_ok(device):
    return None


def split_adapter(cuda=None):
    cuda = cuda or FakeCuda()
    drv = FakeDriver()
    return GreenAdapter(cls=GC213, cuda=cuda, torch_version="2.13.0",
                        driver_split=lambda sizes, i: green_driver.split(sizes, i, drv=drv, cuda=cuda))


def test_auto_takes_green_contexts_and_binds_on_engine_threads():
    cuda = FakeCuda()
    b = choose_backend("auto", "cuda:0", green=split_adapter(cuda), mps=with_mps, cuda_check=cuda_ok)
    assert isinstance(b, GreenContextBackend) and b.enforced
    made = b.prepare({"chat": 40, "classifier": 40, "batch": 20})
    assert made["disjoint"] and made["groups"]["batch"] == {"num_sms": 20, "actual_num_sms": 24}
    streams, ready, done = {}, threading.Barrier(4), threading.Event()

    def engine(model, n):
        h = b.bind(model, n, group=model)
        streams[model] = cuda.current_stream()  # this thread's kernels go to its green stream
        ready.wait(5)
        done.wait(5)
        b.unbind(model)
        streams[model + ":after"] = cuda.current_stream()

    threads = [threading.Thread(target=engine, args=a) for a in (("chat", 40), ("classifier", 40), ("batch", 20))]
    for t in threads:
        t.start()
    ready.wait(5)
    s = b.status()
    assert s["summary"] == ("SM partitions: green contexts on cuda:0, disjoint (batch 24 SMs, chat 40 SMs, "
                            "classifier 40 SMs; work queues shared)")
    assert s["enforced"] and s["models"]["batch"]["actual_num_sms"] == 24 and s["models"]["batch"]["group"] == "batch"
    assert cuda.current_stream() is cuda.default  # the main thread is untouched
    done.set()
    for t in threads:
        t.join(5)
    assert len({id(streams[m]) for m in ("chat", "classifier", "batch")}) == 3
    assert all(streams[m + ":after"] is cuda.default for m in ("chat", "classifier", "batch"))
    assert b.status()["models"] == {}
    b.close()


def test_green_without_a_split_says_partitions_may_overlap(monkeypatch):
    monkeypatch.setattr(green_driver, "load_driver", lambda: (_ for _ in ()).throw(ImportError("no cuda-python")))
    GC213.log.clear()
    b = choose_backend("green_context", "cuda:0", green=adapter(GC213), mps=no_mps, cuda_check=cuda_ok)
    assert not b.enforced and "may share SMs" in b.split_how
    made = b.prepare({"chat": 40, "batch": 64})
    assert made["disjoint"] is False and "may share SMs" in made["how"]
    h = b.bind("chat", 40)  # its own context, made per model
    assert ("create", 40, "balanced", 0) in GC213.log and h.entered
    assert "capped, may share SMs" in b.status()["summary"]
    b.unbind("chat")
    assert GC213.log[-1] == "pop_context"


def test_torch_split_is_used_where_torch_has_it():
    GCMain.log.clear()
    b = choose_backend("green_context", "cuda:0", green=adapter(GCMain), mps=no_mps, cuda_check=cuda_ok)
    made = b.prepare({"a": 64, "b": 64})
    assert made["how"] == "torch GreenContext.split" and GCMain.log[-1] == ("split", (64, 64), "balanced")
    b.bind("a", 64)
    with pytest.raises(RuntimeError, match="already bound"):
        b.bind("a", 64)
    with pytest.raises(RuntimeError, match="unbind a before"):
        b.prepare({"a": 64})
    b.unbind("a")


def test_auto_falls_back_to_mps_then_none():
    class NoGreen(GC213):
        @staticmethod
        def create(*, num_sms=None, workqueue_scope=None, workqueue_concurrency_limit=None, device_id=None):
            raise RuntimeError("CUDA driver too old")

    b = choose_backend("auto", "cuda:0", green=adapter(NoGreen), mps=with_mps, cuda_check=cuda_ok)
    assert isinstance(b, MpsBackend) and b.enforced  # every model then runs in a worker process under MPS
    assert b.status()["summary"] == ("SM partitions: MPS on cuda:0, one engine worker process per model "
                                     "(no worker yet)")
    assert "too old" in b.status()["green_context"]
    b = choose_backend("auto", "cuda:0", green=adapter(NoGreen), mps=no_mps, cuda_check=cuda_ok)
    assert isinstance(b, NoPartitions)
    assert b.status()["summary"].startswith("SM partitions: not enforced (green contexts: green context creation")
    assert "MPS: no MPS control daemon" in b.status()["summary"]
    with pytest.raises(UserError, match="sharing.backend green_context is not available on cuda:0: .*too old"):
        choose_backend("green_context", "cuda:0", green=adapter(NoGreen), mps=with_mps, cuda_check=cuda_ok)
    with pytest.raises(UserError, match="sharing.backend mps is not available on cuda:0: no MPS control daemon"):
        choose_backend("mps", "cuda:0", mps=no_mps, cuda_check=cuda_ok)
    assert choose_backend("none", "cuda:0", cuda_check=cuda_ok).status()["summary"] == \
        "SM partitions: not enforced (sharing.backend: none)"


# ---- MPS ----------------------------------------------------------------------------------------------
def test_mps_percentages_round_up_to_at_least_the_plan():
    assert active_thread_percentage(40, 132) == 31  # 30.3% -> 31% (41 SMs): never fewer than planned
    assert active_thread_percentage(66, 132) == 50  # exact stays exact
    assert active_thread_percentage(1, 132) == 1
    assert active_thread_percentage(132, 132) == 100
    assert active_thread_percentage(40, 108) == 38
    with pytest.raises(ValueError):
        active_thread_percentage(0, 132)


def test_mps_worker_env():
    assert worker_env(40, 108, 30 * 10**9) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "38",
                                              "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=28611M"}
    assert worker_env(24, 108, 2**30, device_index=1, pipe_directory="/run/mps") == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "23", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=1024M",
        "CUDA_MPS_PIPE_DIRECTORY": "/run/mps"}
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in worker_env(24, 108, None)
    b = MpsBackend(with_mps(), 0)
    env = b.worker_env("chat", 40, 108, 25 * 2**30)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=25600M"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert env["CUDA_VISIBLE_DEVICES"] == "0"  # the worker sees its one GPU as device 0
    assert b.worker_env("other", 40, 108, None, device_index=1)["CUDA_VISIBLE_DEVICES"] == "1"  # routed to cuda:1
    b.unbind("other")
    assert b.bind("chat", 40) is None and b.env_of("chat") == env
    b.worker_started("chat", 4242)
    assert b.status()["workers"] == {"chat": {"pid": 4242, "env": env}}
    assert b.status()["summary"] == "SM partitions: MPS on cuda:0, one engine worker process per model " \
                                    "(chat 38% pid 4242)"
    b.unbind("chat")
    assert b.status()["workers"] == {} and b.env_of("chat") is None


def test_detect_mps(tmp_path):
    assert not detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}, process_names=[]).found
    os.mkfifo(tmp_path / "control")
    d = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}, process_names=[])
    assert d.found and d.pipe_directory == str(tmp_path) and "control pipe" in d.how
    d = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "elsewhere")},
                   process_names=[(1, "bash"), (4242, "nvidia-cuda-mps-control")])
    assert d.found and "process 4242" in d.how
    assert not detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")}, process_names=[(1, "x")]).found


# ---- gpu_check.py's parts that need no GPU ----------------------------------------------------------------
def load_gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


H200 = {"name": "NVIDIA H200", "num_sms": 132, "memory_bytes": 143 * 2**30, "compute_capability": "9.0"}


def test_gpu_check_plan_and_its_marked_fallback(monkeypatch):
    gc = load_gpu_check()
    plan = gc.make_plan(H200)
    assert sum(plan["groups"].values()) + plan["spare_sms"] == 132
    assert all(n % 8 == 0 and n >= 8 for n in plan["groups"].values())
    monkeypatch.setitem(sys.modules, "gpuservd.sharing.planner", None)  # the planner missing
    fallback = gc.make_plan(H200)
    assert fallback["source"].startswith("FALLBACK") and fallback["groups"] == {"chat": 48, "classifier": 48,
                                                                                  "batch": 32}
    assert gc.slug("NVIDIA H200") == "h200" and gc.slug("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"


def test_gpu_check_markdown_of_a_full_result():
    gc = load_gpu_check()
    reading = {"sm_util_pct": 99.0, "sm_active_pct": 97.5, "mem_bw_util_pct": 12.0, "read_ms": 0.4,
               "unavailable": {"sm_occupancy_pct": "x"}, "load_stats": {"tflops": 700.0}}
    way = {"groups": {"chat": {"asked_sms": 56, "smid": {"method": "triton", "num_sm_ids": 56, "sm_ids": []},
                               "matmul_tflops_alone": 300.0, "matmul_tflops_together": 290.0},
                      "batch": {"asked_sms": 32, "smid": {"error": "could not verify: ..."}}},
           "overlap_sm_ids": {"chat&batch": 0}}
    r = {"date": "2026-12-01", "seconds": 200.0, "device": {**H200, "nvml": {"driver_version": "580"}},
         "parts": {"device": {"ok": True, "seconds": 20.0}, "isolation": {"ok": False, "seconds": 3.0}},
         "readings": {"idle": {"unavailable": {}}, "matmul": reading}, "plan": gc.make_plan(H200),
         "green": {"auto": {"summary": "SM partitions: ..."}, "whole_device": {"matmul_tflops": 700.0},
                   "torch_create": way, "backend": way, "prepare": {"how": "x"}},
         "isolation": {"command": "-m gpuservd.cli.main bench isolation", "ok": False, "error": "rc 2"}}
    r["verdict"] = gc.verdict(r["green"])
    assert r["verdict"]["backend"] == {"verified": False, "why": "SM ids not counted for every group"}
    md = gc.markdown(r)
    assert "| chat | 56 | 56 | 300.0 | 290.0 |" in md and "could not verify" in md and "FAILED" in md
    assert "- backend: not verified" in md
    way["groups"]["batch"]["smid"] = {"num_sm_ids": 40, "sm_ids": []}
    way["overlap_sm_ids"] = {"chat&batch": 32}
    v = gc.verdict(r["green"])["torch_create"]
    assert v["verified"] and not v["sm_counts_match"] and not v["disjoint"] and v["sm_ids_shared"] == 32


def test_importing_the_gpu_package_loads_neither_torch_nor_nvml():
    code = ("import sys, gpuservd.gpu.backends, gpuservd.gpu.readings, gpuservd.gpu.green, gpuservd.gpu.mps, "
            "gpuservd.gpu.green_driver; print(sorted(m for m in ('torch', 'pynvml') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr

"""SM-partition enforcement backends (what keeps each model's kernels on its own SMs), chosen once at start and shown in status.

    backend = choose_backend(cfg.sharing.backend, cfg.engine.device)
    backend.status()["summary"]      # one line for status / doctor / the console
    backend.prepare({"chat": 40, "batch": 64})   # the plan's groups -> SMs, before models bind
    backend.bind("chat", 40, group="chat")       # on chat's engine thread, before its engine is built
    backend.unbind("chat")           # on the same thread, when it unloads

- green_context: green contexts on a CUDA device. `prepare(groups)` makes the
  plan's SM groups at once, disjoint (torch's split, else the CUDA driver);
  `bind` gives a model its own stream on its group's context and makes it current
  on the calling (engine) thread, so every kernel that engine launches runs on its
  group's SMs.
- mps: a running MPS control daemon. MPS partitions processes, so under this
  backend every model's engine runs in an engine worker process of its own
  (worker/proxy.py), started with `worker_env(model, ...)`:
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE from its plan group's SMs and
  CUDA_MPS_PINNED_DEVICE_MEM_LIMIT from its memory quota, set before the
  process creates its CUDA context. `worker_started(model, pid)` records the
  worker for status; `bind` does nothing (there is no engine thread here).
- none: nothing keeps models' kernels apart; the arbiter's time slices are all
  there is (config.py: every model is then in one group).
`auto` takes the first of green_context, mps, none that works here. Asking for
green_context or mps where it does not work is a UserError that says why.
"""

from __future__ import annotations

import abc
import threading

from gpuservd.errors import Choice, UserError
from gpuservd.gpu.green import default_adapter
from gpuservd.gpu.mps import MpsDaemon, detect_mps, worker_env
from gpuservd.gpu.readings import NO_CUDA, cuda_index


class Backend(Choice, setting="sharing.backend"):
    """The partition backend a config asks for; `choose_backend` turns it into a PartitionBackend."""

    AUTO = "auto"
    GREEN_CONTEXT = "green_context"
    MPS = "mps"
    NONE = "none"


class PartitionBackend(abc.ABC):
    """The interface: `name`, `enforced`, `status()`, `prepare(groups)`, `bind(model, num_sms, group)`,
    `unbind(model)`, `close()`."""

    name = "none"
    enforced = False  # True only when models' kernels are kept to their SMs

    @abc.abstractmethod
    def summary(self) -> str:
        """One line for a person: what is enforced, on which device, and why not when it is not."""

    def status(self) -> dict:
        return {"name": self.name, "enforced": self.enforced, "summary": self.summary()}

    def prepare(self, groups: dict[str, int]) -> dict:
        """The plan's SM groups (group -> SMs), before models bind; returns what was made ({}: nothing)."""
        return {}

    def bind(self, model: str, num_sms: int, group: str | None = None):
        """Called on `model`'s engine thread before its engine is built; returns what was bound (or None).
        `group` is the model's SM group (SharingConfig.group_of; default: the model's own name)."""
        return None

    def unbind(self, model: str) -> None:
        """Called on the same thread as `bind`, when the model unloads (for a worker process: when it leaves)."""

    def worker_started(self, model: str, pid: int) -> None:
        """`model`'s engine worker process runs as `pid` (engine.isolation: process)."""

    def env_of(self, model: str) -> dict[str, str] | None:
        """What this backend put in `model`'s worker environment (None: nothing)."""
        return None

    def close(self) -> None:
        """Forget every binding (at shutdown)."""


class NoPartitions(PartitionBackend):
    name = "none"
    enforced = False

    def __init__(self, reason: str):
        self.reason = reason  # why nothing is enforced

    def summary(self) -> str:
        return f"SM partitions: not enforced ({self.reason})"

    def status(self) -> dict:
        return {**super().status(), "reason": self.reason}


class GreenContextBackend(PartitionBackend):
    """Green contexts: `prepare(groups)` makes a plan's groups at once (disjoint where torch or the driver can
    split), then `bind(model, num_sms, group)` on each engine thread gives the model its own stream on its
    group's context and makes it current there. A bind without prepare (or for a group the plan lacks)
    makes a context of its own, capped at num_sms but cut from the whole device (it may share SMs).

    `enforced` is True when groups are kept apart: a disjoint split works here (checked without CUDA work
    at start, confirmed by prepare)."""

    name = "green_context"

    def __init__(self, adapter, device_index: int, offered: str, workqueue_scope: str | None = "balanced"):
        self.adapter = adapter  # a gpu.green.GreenAdapter
        self.device_index = device_index
        self.offered = offered  # what the adapter said it offers
        self.workqueue_scope = workqueue_scope
        self.can_split, self.split_how = adapter.can_split()
        self._lock = threading.Lock()
        self._parts = None  # gpu.green.Partitions of the last prepare()
        self._groups: dict[str, int] = {}  # group -> its index in _parts
        self._bound: dict[str, tuple[str, object]] = {}  # model -> (group, GreenContextHandle)

    @property
    def enforced(self) -> bool:
        if self._parts is not None:
            return self._parts.disjoint
        return self.can_split

    def prepare(self, groups: dict[str, int]) -> dict:
        """Make the plan's groups (group -> SMs, in plan order) as green contexts; returns what was made.
        Models must be unbound first (their streams live on the old contexts)."""
        with self._lock:
            if self._bound:
                raise RuntimeError(f"unbind {', '.join(sorted(self._bound))} before a new plan's partitions")
            old, self._parts, self._groups = self._parts, None, {}
        if old is not None:
            old.close()
        parts = self.adapter.create_partitions(list(groups.values()), self.device_index,
                                               workqueue_scope=self.workqueue_scope)
        with self._lock:
            self._parts, self._groups = parts, {g: i for i, g in enumerate(groups)}
        return self.partitions()

    def partitions(self) -> dict:
        p = self._parts
        if p is None:
            return {}
        return {"disjoint": p.disjoint, "how": p.how, "notes": list(p.notes),
                "groups": {g: {"num_sms": p.sizes[i], "actual_num_sms": p.actual[i]} for g, i in self._groups.items()}}

    def bind(self, model: str, num_sms: int, group: str | None = None):
        group = group or model
        with self._lock:
            if model in self._bound:
                raise RuntimeError(f"model {model!r} is already bound to a green context")
            parts, index = self._parts, self._groups.get(group)
        if parts is not None and index is not None:
            handle = self.adapter.handle_on(parts, index, num_sms, workqueue_scope=self.workqueue_scope)
        else:
            handle = self.adapter.create(num_sms, self.device_index, workqueue_scope=self.workqueue_scope)
        handle.enter()
        with self._lock:
            self._bound[model] = (group, handle)
        return handle

    def unbind(self, model: str) -> None:
        with self._lock:
            bound = self._bound.pop(model, None)
        if bound is not None:
            bound[1].exit()

    def close(self) -> None:
        # contexts entered on engine threads are exited there (unbind); here only the references go
        with self._lock:
            self._bound.clear()
            parts, self._parts, self._groups = self._parts, None, {}
        if parts is not None:
            parts.close()

    def summary(self) -> str:
        with self._lock:
            parts = [f"{m} {h.num_sms} SMs" for m, (_, h) in sorted(self._bound.items())]
            scopes = {h.workqueue_scope or "shared" for _, h in self._bound.values()}
            p = self._parts
        models = ", ".join(parts) if parts else "no model bound yet"
        queues = f"; work queues {'/'.join(sorted(scopes))}" if scopes else ""
        if p is not None:
            apart = "disjoint" if p.disjoint else "capped, may share SMs"
        else:
            apart = "disjoint" if self.can_split else "capped, may share SMs"
        return f"SM partitions: green contexts on cuda:{self.device_index}, {apart} ({models}{queues})"

    def status(self) -> dict:
        with self._lock:
            models = {m: {"group": g, **h.describe()} for m, (g, h) in self._bound.items()}
        return {**super().status(), "device_index": self.device_index, "offered": self.offered,
                "split": self.split_how, "partitions": self.partitions(), "models": models}


class MpsBackend(PartitionBackend):
    """MPS: one engine worker process per model, each started with its SM percentage and memory limit.

    `enforced` is True: every model runs in a worker process under this backend (sharing/manager.py), and
    MPS holds each such process to its percentage of the SMs. How many SMs MPS really grants comes in its
    own granule (see active_thread_percentage); gpu_check measures it."""

    name = "mps"
    enforced = True

    def __init__(self, daemon: MpsDaemon, device_index: int | None, green_reason: str = ""):
        self.daemon = daemon
        self.device_index = device_index
        self.green_reason = green_reason  # why green contexts were not taken (auto), "" if asked for mps
        self._lock = threading.Lock()
        self._env: dict[str, dict[str, str]] = {}  # model -> what its worker's environment adds
        self._pids: dict[str, int] = {}  # model -> its worker process

    def worker_env(self, model: str, num_sms: int, num_sms_total: int, quota_bytes: int | None,
                   device_index: int | None = None) -> dict[str, str]:
        """The environment `model`'s engine worker process gets: the MPS settings, and the one GPU it sees
        (CUDA_VISIBLE_DEVICES: `device_index`, default the backend's device; the limits then name device 0)."""
        pipe = self.daemon.pipe_directory if self.daemon.found else None
        env = worker_env(num_sms, num_sms_total, quota_bytes, device_index=0, pipe_directory=pipe)
        index = self.device_index if device_index is None else device_index
        if index is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(index)
        with self._lock:
            self._env[model] = env
        return env

    def worker_started(self, model: str, pid: int) -> None:
        with self._lock:
            self._pids[model] = pid

    def env_of(self, model: str) -> dict[str, str] | None:
        with self._lock:
            return dict(self._env[model]) if model in self._env else None

    def bind(self, model: str, num_sms: int, group: str | None = None):
        return None  # the model's worker process was started with its settings; there is no thread here to bind

    def unbind(self, model: str) -> None:
        with self._lock:
            self._env.pop(model, None)
            self._pids.pop(model, None)

    def summary(self) -> str:
        with self._lock:
            parts = [f"{m} {e['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}% pid {self._pids.get(m, 'starting')}"
                     for m, e in sorted(self._env.items())]
        where = f"cuda:{self.device_index}" if self.device_index is not None else "the device"
        return (f"SM partitions: MPS on {where}, one engine worker process per model "
                f"({', '.join(parts) if parts else 'no worker yet'})")

    def status(self) -> dict:
        with self._lock:
            workers = {m: {"pid": self._pids.get(m), "env": dict(e)} for m, e in self._env.items()}
        out = {**super().status(), "pipe_directory": self.daemon.pipe_directory, "found_by": self.daemon.how,
               "workers": workers}
        if self.green_reason:
            out["green_context"] = self.green_reason
        return out


def cuda_reason(device: str) -> str | None:
    """None when `device` is a CUDA device torch can use, else why not."""
    index = cuda_index(device)
    if index is None:
        return NO_CUDA
    try:
        import torch  # only for a cuda:N device: the CLI and the config checks import this module

        if not torch.cuda.is_available():
            return NO_CUDA
        if index >= torch.cuda.device_count():
            return f"{NO_CUDA} at index {index} ({torch.cuda.device_count()} visible)"
    except Exception as exc:
        return f"{NO_CUDA} ({exc})"
    return None


def choose_backend(requested: Backend | str, device: str, *, green=None, mps=None, cuda_check=None
                   ) -> PartitionBackend:
    """The backend for `device` (sharing.backend: auto | green_context | mps | none).

    `green` (a GreenAdapter), `mps` (() -> MpsDaemon) and `cuda_check` (device -> reason | None) are for
    tests; by default torch, the MPS pipe and the process list are asked. Creating the adapter's probe
    context is the only CUDA work done here."""
    requested = requested if isinstance(requested, Backend) else Backend.parse(str(requested))
    if requested is Backend.NONE:
        why = (cuda_check or cuda_reason)(device)
        return NoPartitions(why or "sharing.backend: none")
    why = (cuda_check or cuda_reason)(device)
    if why:
        if requested is Backend.AUTO:
            return NoPartitions(why)
        if requested is Backend.GREEN_CONTEXT:  # torch's own reason too (a CPU build, no green contexts)
            ok, what = (green or default_adapter()).available(cuda_index(device))
            why = why if ok or what == why else f"{why}; {what}"
        raise UserError(f"sharing.backend {requested.value} is not available on {device}: {why}")
    index = cuda_index(device)
    green_reason = ""
    if requested in (Backend.AUTO, Backend.GREEN_CONTEXT):
        green = green or default_adapter()
        ok, what = green.available(index, probe=True)
        if ok:
            return GreenContextBackend(green, index, what)
        if requested is Backend.GREEN_CONTEXT:
            raise UserError(f"sharing.backend green_context is not available on {device}: {what}")
        green_reason = what
    daemon = (mps or detect_mps)()
    if daemon.found:
        return MpsBackend(daemon, index, green_reason)
    if requested is Backend.MPS:
        raise UserError(f"sharing.backend mps is not available on {device}: {daemon.how}")
    return NoPartitions(f"green contexts: {green_reason}; MPS: {daemon.how}")

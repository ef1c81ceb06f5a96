"""CUDA green contexts across torch versions: one SM group and stream per model, inside one process.

    ok, reason = available(device_index=0)
    g = create(num_sms=40, device_index=0)   # workqueue_scope="balanced" where torch offers it
    g.enter()      # on the model's engine thread: its kernels now run on those SMs, on g.stream
    ...
    g.exit()       # on the same thread: the previous context and stream are current again

torch's API changed shape from release to release (torch/cuda/green_contexts.py in pytorch's history);
the adapter looks at what the installed torch offers rather than at its version number:
  create_positional  GreenContext.create(num_sms, device_id=0): the first releases (2.9 with
                     make_current()/pop_current(); then set_context()/pop_context() and Stream(), the
                     class now torch._C._CUDAGreenContext; a later one added create_localized)
  create_kw          GreenContext.create(*, num_sms=, workqueue_scope=, workqueue_concurrency_limit=,
                     device_id=), set_context()/pop_context(), Stream() (torch 2.13, installed here)
  constructor        GreenContext(num_sms=|sm_partition=, workqueue_scope=, ...), a pure Python class over
                     cuda.bindings; set_context()/pop_context() deprecated in favour of
                     `with torch.cuda.stream(ctx.Stream())` (pytorch main after 2.13)
Entering: set_context / make_current push the green context on the calling thread's CUDA context
stack and make its stream torch's current stream (both per thread); the constructor shape needs no
context push, so entering makes the green context's stream current, with an event so the new stream
waits for work already queued on the old one (and the reverse on exit).

Disjoint partitions: before the constructor shape, torch's create() cuts every context from the
whole device, so contexts made one by one can share SMs (each is only capped at its count).
`create_partitions(sizes)` makes a plan's groups at once and disjoint: torch's
GreenContext.split where it exists, else the CUDA driver through cuda-python (green_driver.py);
only when neither works does it fall back to one create() per group, and says so (`disjoint`).

workqueue_scope="balanced" gives each green context its own hardware work queues, so one model's
launches do not queue behind another's on shared queues (the default, "device_ctx", shares them:
SMs apart, launches still serialised). It needs a CUDA 13.1+ driver; where torch or the driver
refuses it the context is created without it and `note` says so.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field

from gpuservd.gpu import green_driver

PROBE_NUM_SMS = 8  # a probe context: the smallest count every architecture accepts (Hopper's granule is 8)


@dataclass
class GreenApi:
    """What the installed torch's GreenContext offers."""

    shape: str  # "create_positional" | "create_kw" | "constructor" | "driver" (see the module docstring)
    enter: str  # "make_current" | "set_context" | "stream": how a thread starts using a context
    workqueue: bool  # create() takes workqueue_scope
    has_stream: bool  # the context has Stream()


def describe_api(cls) -> GreenApi | str:
    """The API shape of a GreenContext class, or why it cannot be used."""
    create = getattr(cls, "create", None)
    if create is None:
        return "GreenContext has no create()"
    try:
        params = inspect.signature(create).parameters
    except (TypeError, ValueError):  # a C function without a signature: the oldest, positional form
        params = {}
    workqueue = "workqueue_scope" in params
    has_stream = callable(getattr(cls, "Stream", None))
    if "sm_partition" in params or callable(getattr(cls, "split", None)):
        if not has_stream:
            return "GreenContext has neither Stream() nor a context stack this adapter knows"
        return GreenApi("constructor", "stream", workqueue, True)
    keyword_only = bool(params) and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    shape = "create_kw" if workqueue or keyword_only else "create_positional"
    if callable(getattr(cls, "set_context", None)):
        return GreenApi(shape, "set_context", workqueue, has_stream)
    if callable(getattr(cls, "make_current", None)):
        return GreenApi(shape, "make_current", workqueue, has_stream)
    return "GreenContext has neither set_context() nor make_current()"


class GreenContextHandle:
    """One green context: `enter()`/`exit()` on one thread, `stream` its stream, `num_sms` as asked."""

    def __init__(self, ctx, api: GreenApi, cuda, num_sms: int, device_index: int, workqueue_scope: str | None,
                 note: str = ""):
        self.ctx = ctx  # keeps the context alive as long as the handle
        self.api = api
        self.cuda = cuda
        self.num_sms = num_sms  # asked for; the driver rounds up to its granule (actual_num_sms where known)
        self.device_index = device_index
        self.workqueue_scope = workqueue_scope  # applied, or None
        self.note = note
        self._stream = ctx.Stream() if api.has_stream else None  # constructor shape: a new stream per call
        self._prev = None
        self._thread: int | None = None

    @property
    def actual_num_sms(self) -> int | None:
        """The SM count the driver gave, where torch tells it (the constructor shape); else None."""
        try:
            n = getattr(self.ctx, "sm_count", None)
            return int(n) if n is not None else None
        except Exception:
            return None

    @property
    def stream(self):
        """The green context's stream; for the oldest shape (no Stream()) the current one while entered."""
        if self._stream is None and self._thread is not None:
            return self.cuda.current_stream(self.device_index)
        return self._stream

    @property
    def entered(self) -> bool:
        return self._thread is not None

    def enter(self) -> None:
        """Make this green context (and its stream) current on the calling thread."""
        if self._thread is not None:
            raise RuntimeError("green context already entered (on thread %d)" % self._thread)
        if self.api.enter == "stream":
            prev = self.cuda.current_stream(self.device_index)
            event = self.cuda.Event()
            event.record(prev)
            self._stream.wait_event(event)  # work queued before enter() runs first
            self.cuda.set_stream(self._stream)
            self._prev = prev
        elif self.api.enter == "set_context":
            self.ctx.set_context()
        else:
            self.ctx.make_current()
        self._thread = threading.get_ident()

    def exit(self) -> None:
        """Restore the context and stream that were current before `enter()`; same thread only (CUDA's
        context stack and torch's current stream are per thread)."""
        if self._thread is None:
            return
        if self._thread != threading.get_ident():
            raise RuntimeError("green context exit() on another thread than its enter()")
        try:
            if self.api.enter == "stream":
                event = self.cuda.Event()
                event.record(self._stream)
                self._prev.wait_event(event)  # later work on the old stream sees this context's results
                self.cuda.set_stream(self._prev)
                self._prev = None
            elif self.api.enter == "set_context":
                self.ctx.pop_context()
            else:
                self.ctx.pop_current()
        finally:
            self._thread = None

    def __enter__(self):
        self.enter()
        return self

    def __exit__(self, *exc):
        self.exit()

    def describe(self) -> dict:
        return {"num_sms": self.num_sms, "actual_num_sms": self.actual_num_sms, "device_index": self.device_index,
                "workqueue_scope": self.workqueue_scope, "api": self.api.shape, "note": self.note or None}


DRIVER_API = GreenApi("driver", "stream", False, True)  # contexts made by green_driver.split


@dataclass
class Partitions:
    """A plan's SM groups as green contexts, made at once."""

    device_index: int
    sizes: list[int]  # SMs asked per group, in order
    contexts: list  # one per group; None = made per model at bind time (the overlapping fallback)
    api: GreenApi  # how the contexts are entered
    disjoint: bool  # True: no two groups share an SM
    how: str  # what made them (and, for the fallback, why nothing better)
    workqueue_scope: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def actual(self) -> list[int | None]:
        """SMs each group got, where the maker tells (the driver rounds up to its granule)."""
        out = []
        for c in self.contexts:
            try:
                out.append(int(c.sm_count) if c is not None and getattr(c, "sm_count", None) is not None else None)
            except Exception:
                out.append(None)
        return out

    def close(self) -> None:
        for c in self.contexts:
            if c is not None and callable(getattr(c, "close", None)):
                c.close()


class GreenAdapter:
    """Green contexts through the installed torch (or, in tests, a stand-in `cls` and `cuda`)."""

    def __init__(self, cls=None, cuda=None, torch_version: str | None = None, cuda_version: str | None = "auto",
                 supported: bool = True, driver_split=None):
        self._reason: str | None = None
        self._driver_split = driver_split  # (sizes, device_index) -> contexts; default green_driver.split
        if cls is None or cuda is None:
            try:  # torch only when an adapter is made: the CLI imports this package to report on it
                import torch
            except ImportError:
                self._reason = "torch not installed"
                return
            torch_version, cuda_version = torch.__version__, torch.version.cuda
            cuda = cuda or torch.cuda
            if cls is None:
                try:
                    from torch.cuda import green_contexts as gc  # torch >= 2.9 only; older ones say why
                except ImportError:
                    self._reason = f"torch {torch_version} has no torch.cuda.green_contexts (it came in 2.9)"
                    return
                cls = gc.GreenContext
                supported = getattr(gc, "SUPPORTED", True)
        self.cls, self.cuda = cls, cuda
        self.torch_version = torch_version
        self.cuda_version = None if cuda_version == "auto" else cuda_version
        if cuda_version is None:
            self._reason = f"torch {torch_version} is a CPU build"
        elif not supported:
            self._reason = f"torch {torch_version} was built without green context support"
        if self._reason:
            return
        api = describe_api(cls)
        if isinstance(api, str):
            self._reason = f"torch {torch_version}: {api}"
        else:
            self.api = api

    def available(self, device_index: int | None = None, probe: bool = False) -> tuple[bool, str]:
        """(True, what is offered) or (False, why not). `probe` creates (and drops) a small context on the
        device: the only way to learn that the driver accepts green contexts."""
        if self._reason:
            return False, self._reason
        try:
            if not self.cuda.is_available():
                return False, "no CUDA device"
            if device_index is not None and device_index >= self.cuda.device_count():
                return False, f"no CUDA device at index {device_index}"
        except Exception as exc:
            return False, f"no CUDA device ({exc})"
        what = (f"green contexts (torch {self.torch_version}, API {self.api.shape}, "
                f"workqueue_scope {'offered' if self.api.workqueue else 'not offered'})")
        if probe:
            index = device_index or 0
            try:
                total = self.cuda.get_device_properties(index).multi_processor_count
                handle = self.create(min(PROBE_NUM_SMS, total), index)
                del handle
            except Exception as exc:
                return False, f"green context creation failed on cuda:{index}: {type(exc).__name__}: {exc}"
        return True, what

    def create(self, num_sms: int, device_index: int, *, workqueue_scope: str | None = "balanced"
               ) -> GreenContextHandle:
        """A green context of `num_sms` SMs on device `device_index` (raises RuntimeError with the reason)."""
        if self._reason:
            raise RuntimeError(f"green contexts unavailable: {self._reason}")
        if num_sms <= 0:
            raise ValueError(f"num_sms must be > 0, got {num_sms}")
        api, note, scope = self.api, "", None
        if api.shape == "create_positional":
            ctx = self.cls.create(num_sms, device_index)
            if workqueue_scope:
                note = f"workqueue_scope not offered by torch {self.torch_version}: launches share work queues"
        else:
            kwargs = {"num_sms": num_sms, "device_id": device_index}
            ctx = None
            if workqueue_scope and api.workqueue:
                try:
                    ctx = self.cls.create(**kwargs, workqueue_scope=workqueue_scope)
                    scope = workqueue_scope
                except Exception as exc:  # typically a driver older than CUDA 13.1
                    note = f"workqueue_scope={workqueue_scope} refused ({exc}); created without it"
            elif workqueue_scope:
                note = f"workqueue_scope not offered by torch {self.torch_version}: launches share work queues"
            if ctx is None:
                ctx = self.cls.create(**kwargs)
        return GreenContextHandle(ctx, api, self.cuda, num_sms, device_index, scope, note)


    def can_split(self) -> tuple[bool, str]:
        """Whether `create_partitions` can make disjoint groups here, and by what (or why not); no CUDA work."""
        if self._reason:
            return False, self._reason
        if self.api.shape == "constructor" and callable(getattr(self.cls, "split", None)):
            return True, "torch GreenContext.split"
        if self._driver_split is not None:
            return True, "the CUDA driver (cuda.bindings)"
        try:
            green_driver.load_driver()
        except ImportError as exc:
            return False, (f"torch {self.torch_version} has no GreenContext.split and {exc}: partitions are "
                           "capped at their SM count but may share SMs")
        return True, "the CUDA driver (cuda.bindings)"

    def create_partitions(self, sizes: list[int], device_index: int, *,
                          workqueue_scope: str | None = "balanced") -> Partitions:
        """Green contexts for a plan's groups, disjoint where possible (see the module docstring)."""
        if self._reason:
            raise RuntimeError(f"green contexts unavailable: {self._reason}")
        tried = []
        if self.api.shape == "constructor" and callable(getattr(self.cls, "split", None)):
            kwargs = {"num_sms": tuple(sizes), "device_id": device_index}
            for scope in ([workqueue_scope, None] if workqueue_scope and self.api.workqueue else [None]):
                try:
                    ctxs = self.cls.split(**kwargs, **({"workqueue_scope": scope} if scope else {}))
                    return Partitions(device_index, list(sizes), list(ctxs), self.api, True,
                                      "torch GreenContext.split", scope, tried[:])
                except Exception as exc:
                    tried.append(f"GreenContext.split(workqueue_scope={scope}): {type(exc).__name__}: {exc}")
        try:
            if self._driver_split is not None:
                ctxs = self._driver_split(list(sizes), device_index)
            else:
                ctxs = green_driver.split(list(sizes), device_index)
            notes = tried + (["work queues shared (the driver path sets no workqueue scope)"]
                             if workqueue_scope else [])
            return Partitions(device_index, list(sizes), list(ctxs), DRIVER_API, True,
                              "the CUDA driver (cuda.bindings)", None, notes)
        except Exception as exc:
            tried.append(f"driver split: {type(exc).__name__}: {exc}")
        how = ("one torch GreenContext.create per group: each capped at its SM count, but every one is cut "
               "from the whole device, so groups may share SMs")
        return Partitions(device_index, list(sizes), [None] * len(sizes), self.api, False, how, None, tried)

    def handle_on(self, parts: Partitions, index: int, num_sms: int, *,
                  workqueue_scope: str | None = "balanced") -> GreenContextHandle:
        """A handle for one model on group `index` of `parts`: its own stream on the group's context (or, in
        the fallback, its own context)."""
        ctx = parts.contexts[index]
        if ctx is None:
            return self.create(num_sms, parts.device_index, workqueue_scope=workqueue_scope)
        got = parts.actual[index]
        return GreenContextHandle(ctx, parts.api, self.cuda, got or parts.sizes[index], parts.device_index,
                                  parts.workqueue_scope, "; ".join(parts.notes))

_default: GreenAdapter | None = None


def default_adapter() -> GreenAdapter:
    global _default
    if _default is None:
        _default = GreenAdapter()
    return _default


def available(device_index: int | None = None, probe: bool = False) -> tuple[bool, str]:
    return default_adapter().available(device_index, probe)


def create(num_sms: int, device_index: int = 0, *, workqueue_scope: str | None = "balanced") -> GreenContextHandle:
    return default_adapter().create(num_sms, device_index, workqueue_scope=workqueue_scope)

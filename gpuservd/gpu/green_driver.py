"""Disjoint green contexts through the CUDA driver API (the cuda-python package's cuda.bindings.driver).

Why not torch: up to torch 2.13, `GreenContext.create(num_sms=n)` cuts n SMs out of the *whole
device* every time (cuDevSmResourceSplitByCount on cuDeviceGetDevResource), so two contexts made
one after the other can get the same SMs: each is capped at its count, but nothing keeps them
apart. Later torch offers `GreenContext.split(num_sms=(a, b, ...))`, whose groups are disjoint;
here the same thing is done for the torch versions before it:

    resource = the device's SMs
    for each partition but the last:  (group, rest) = split(resource, n); resource = SMs of a context made of rest
    the last partition is split from what is left; what remains after it is the spare (the planner's elastic buffer)

The driver rounds each count up to its granule (8 SMs on Hopper); `sm_count` is what it gave.
Work reaches a partition through streams made with cuGreenCtxStreamCreate, wrapped as torch
ExternalStreams: a thread makes one current (green.GreenContextHandle, the "stream" way in); no
CUDA context is pushed, so kernels loaded by torch, Triton or extensions in the primary context
launch on them unchanged. Work queues are the device's default ("device_ctx" scope).
"""

from __future__ import annotations

STREAM_POOL = 32  # streams made per partition, then reused round-robin (as torch does)


def load_driver():
    """The cuda.bindings driver module, or raise ImportError with the reason."""
    try:
        from cuda.bindings import driver  # optional: cuda-python, on CUDA machines only
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python before 12.6
        except ImportError:
            raise ImportError("the cuda-python package (cuda.bindings) is not installed") from None
    return driver


def _check(drv, result):
    """cuda.bindings returns (CUresult, values...): the values, or RuntimeError with the error's name."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        try:
            _, text = drv.cuGetErrorString(err)
            text = text.decode() if isinstance(text, bytes) else str(text)
        except Exception:
            text = str(err)
        raise RuntimeError(f"CUDA driver: {text}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


class _Remainders:
    """The remainder contexts one split made: destroyed when the last partition of that split closes."""

    def __init__(self, drv):
        self.drv, self.contexts, self.users = drv, [], 0

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            for g in self.contexts:
                try:
                    self.drv.cuGreenCtxDestroy(g)
                except Exception:
                    pass
            self.contexts = []


class DriverGreenContext:
    """A green context made here: `Stream()` (a torch ExternalStream on it), `sm_count`, `close()`."""

    def __init__(self, drv, cuda, green_ctx, device_index: int, sm_count: int, keep: _Remainders):
        self.drv, self.cuda = drv, cuda
        self.green_ctx = green_ctx
        self.device_index = device_index
        self.sm_count = sm_count  # what the driver gave (the request rounded up to its granule)
        self._keep = keep  # the remainder contexts this one was split from, alive as long as it is
        keep.users += 1
        self._streams: list = []
        self._next = 0

    def Stream(self):  # noqa: N802 (torch's name)
        if len(self._streams) < STREAM_POOL:
            handle = _check(self.drv, self.drv.cuGreenCtxStreamCreate(
                self.green_ctx, self.drv.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
            self._streams.append(handle)
        else:
            handle = self._streams[self._next % STREAM_POOL]
            self._next += 1
        return self.cuda.ExternalStream(int(handle), device=self.device_index)

    def close(self) -> None:
        """Destroy its streams and the context (the caller has synchronised the work on them)."""
        for s in self._streams:
            try:
                self.drv.cuStreamDestroy(s)
            except Exception:
                pass
        self._streams = []
        if self.green_ctx is not None:
            try:
                self.drv.cuGreenCtxDestroy(self.green_ctx)
            except Exception:
                pass
            self.green_ctx = None
            self._keep.release()


def split(sizes: list[int], device_index: int, *, drv=None, cuda=None) -> list[DriverGreenContext]:
    """Disjoint green contexts of `sizes` SMs (in order) on device `device_index`; RuntimeError when the
    device cannot hold them (the message says which count failed and what was left)."""
    if drv is None:
        drv = load_driver()
    if cuda is None:
        import torch  # only when contexts are made: the gpu package is imported by torch-free commands

        cuda = torch.cuda
        torch.cuda.init()  # the primary context first (creating a green context retains it)
    sm_type = drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
    flags = drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
    _check(drv, drv.cuInit(0))
    device = _check(drv, drv.cuDeviceGet(device_index))
    resource = _check(drv, drv.cuDeviceGetDevResource(device, sm_type))
    made: list[DriverGreenContext] = []
    keep = _Remainders(drv)  # remainder contexts (their SM resources are the next inputs)

    def create(res):
        desc = _check(drv, drv.cuDevResourceGenerateDesc([res], 1))
        return _check(drv, drv.cuGreenCtxCreate(desc, device, flags))

    try:
        for i, n in enumerate(sizes):
            left = int(resource.sm.smCount)
            if n <= 0 or n > left:
                raise RuntimeError(f"partition {i}: {n} SMs asked, {left} left of the device")
            groups, num_groups, rest = _check(drv, drv.cuDevSmResourceSplitByCount(1, resource, 0, n))
            if int(num_groups) != 1:
                raise RuntimeError(f"partition {i}: the driver made {num_groups} groups of {n} SMs from {left}")
            group = groups[0]
            made.append(DriverGreenContext(drv, cuda, create(group), device_index, int(group.sm.smCount), keep))
            if i + 1 < len(sizes):
                if int(rest.sm.smCount) == 0:
                    raise RuntimeError(f"partition {i + 1}: no SMs left after {sum(c.sm_count for c in made)}")
                # a split's output cannot be split again until a green context is made of it
                rest_ctx = create(rest)
                keep.contexts.append(rest_ctx)
                resource = _check(drv, drv.cuGreenCtxGetDevResource(rest_ctx, sm_type))
    except Exception:
        for c in made:
            c.close()
        keep.users = 0
        keep.release()
        raise
    return made

"""The models the daemon hosts: slots, loads, pins, eviction, device routing, prefetch, workers.

Each model has a `ModelSlot`; its engine runs on its own EngineLoop thread, or in an engine worker process
behind a WorkerLoop (`engine.isolation`; auto: a CPU model's, serving/model_workers.py). A load picks the
fastest weight tier (weights/sources.py), makes room on a device by evicting least recently used idle
models (an LRU with a size limit; a model inside its keep_alive stays, and a load that finds no room is a
503 until then), and builds the engine where it will be stepped.

Devices: `engine.devices` lists the daemon's devices (empty = the one `engine.device`). Every slot
carries the device it runs on; a request for a model resident on a device goes there (a hit), and a load
goes to the device `routing.choose_device` picks from the weight cache's per-device plans (no eviction
first, then fewer bytes and models to evict, then the lighter load, then the lower index). A model runs
on one device at a time; a variant runs where its base's weights are.

Ending a model's requests (before an unload or eviction) is the request side's: the owner passes `end_requests`.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from functools import partial
from pathlib import Path
from typing import Awaitable, Callable

from gpuservd.config import torch_device
from gpuservd.serving.daemon_config import DaemonConfig
from gpuservd.engine.agreement import int8_verdict
from gpuservd.engine.tokenizer import load_tokenizer
from gpuservd.engine.calls import EngineFacts, request_views, reset_prefix_cache, set_tenant_quotas
from gpuservd.engine.loop import AnyEngineLoop, EngineLoop
from gpuservd.errors import ModelNotServed, ModelPinned, ModelUnavailable, UserError, InvalidRequest
from gpuservd.events import EventBus
from gpuservd.events.types import CacheHitRateLow, ModelEvict, ModelLoad, ModelPin, ModelUnload, Prefetch
from gpuservd.serving.request_stream import ModelSlot
from gpuservd.serving.routing import VersionRouter, pick_plan
from gpuservd.runner.cpu_budget import CpuBudget
from gpuservd.runner.model_config import load_arch
from gpuservd.sharing.manager import SharingManager
from gpuservd.store.store import ModelStore
from gpuservd.weights.cache import CacheFull, WeightCache
from gpuservd.weights.prefetch import HitRateWatch, PrefetchStats, Predictor
from gpuservd.weights.sources import WeightSources
from gpuservd.worker.build import make_engine
from gpuservd.serving.model_workers import replenish_spare, spare_worker, worker_exited, worker_loop, worker_ready
from gpuservd.wire.status import ModelStatus

log = logging.getLogger("gpuservd.serving.models")
LOAD_RETRY_S = 10.0  # a model whose load failed is tried again on demand after this long

EndRequests = Callable[[ModelSlot, float], Awaitable[tuple[int, int]]]


class Models:
    """The hosted models and everything about placing, loading and freeing them."""

    def __init__(self, config: DaemonConfig, quotas, metrics, bus: EventBus, device: dict,
                 end_requests: EndRequests):
        self.config = config
        self.quotas = quotas  # tenant name -> TenantQuota, handed to every engine
        self.metrics = metrics  # api.metrics.Metrics (None in some tests): engine hooks and model gauges
        self.bus = bus
        self.device = device  # what the daemon runs on (backend, name, ...)
        self._end_requests = end_requests  # let a slot's requests finish up to a timeout, abort the rest
        self.slots: dict[str, ModelSlot] = {}
        self.devices = config.engine.device_names()  # [engine.device] unless engine.devices lists several
        self.cache = WeightCache(config.cache, config.engine.device_memory_bytes, self.devices)
        self.sources = WeightSources(self.cache, lambda: config.engine, config.cache.compression)
        self._load_failed_at: dict[str, float] = {}  # model -> monotonic time its last load failed
        self._device_full: dict[str, CacheFull] = {}  # model -> why its last load found no room (none loading)
        self._load_tasks: dict[str, asyncio.Future] = {}  # on-demand loads in progress
        self.load_waiters: dict[str, int] = {}  # model -> requests waiting for its load (counted as waiting)
        self.router = VersionRouter(config.server.versions)
        self.predictor = Predictor(min_prob=config.cache.prefetch_min_prob)
        self.prefetch_stats = PrefetchStats()
        self.hit_rate = HitRateWatch(config.cache.hit_rate_window)
        self.sharing = SharingManager(config, device)  # backend, plan, arbiter, quotas, readings
        self.cpu_budget = CpuBudget()  # the CPU's cores split among the engines stepping at once
        self.spare = spare_worker(self)  # a worker process started ahead for the next load that needs one

    def model_names(self, ready_only: bool = True) -> list[str]:
        return sorted(n for n, s in self.slots.items() if s.state == "ready" or not ready_only)

    def slot(self, name: str) -> ModelSlot:
        """The slot of a hosted model (loaded, loading or failed), else ModelNotServed naming the others."""
        slot = self.slots.get(name)
        if slot is None:
            raise ModelNotServed(f"model {name} is not loaded; loaded: {', '.join(self.model_names(False)) or 'none'}",
                                 "model")
        return slot

    def set_tenant_quotas(self, quotas) -> None:
        """New tenant quotas (reload): for engines built from now on, and to the running ones between steps."""
        self.quotas = quotas
        for slot in self.slots.values():
            if slot.loop is not None and slot.loop.alive:
                slot.loop.call(partial(set_tenant_quotas, quotas))

    def on_post(self, deliveries: list, events: list) -> None:
        """From an engine thread, once per iteration: outputs to their requests, events to readers."""
        for sink, item in deliveries:
            sink.put(item)
        for event in events:
            self.bus.publish(event)

    # ---- on demand: load, hit rate, prefetch ------------------------------------------------------
    async def ensure_loaded(self, name: str, draining: bool) -> None:
        """Load on demand: a request for a store model that is not on the device starts its load,
        and every request for it waits on that one load; other models keep serving meanwhile. Returns
        without loading when the model cannot be loaded now: admission then refuses the request."""
        cc = self.config.cache
        slot = self.slots.get(name)
        if slot is None and name not in ModelStore().names():
            return  # admission answers 404; a name that is no model leaves no trace (no per-name state)
        on_device = slot is not None and slot.state == "ready"
        self.cache.touch(name)
        self.prefetch_stats.requested(name, slot is not None and slot.state in ("ready", "loading"))
        self.predictor.observe(name)
        self._watch_hit_rate(name, on_device)
        if cc.prefetch and not draining:
            self._prefetch_after(name)
        if on_device or draining:
            return
        if slot is None or slot.state == "failed":
            if not cc.load_on_demand or time.monotonic() - self._load_failed_at.get(name, -1e9) < LOAD_RETRY_S:
                return  # admission answers (404 naming the failure, until it may be retried)
            if slot is not None and name not in ModelStore().names():
                return  # a failed model since removed from the store: admission answers 404
            task = self._load_tasks.get(name)
            if task is None or task.done():  # one load, however many requests wait on it (no load thrash)
                task = self._load_tasks[name] = asyncio.ensure_future(self._load_quietly(name))
            waiter = asyncio.shield(task)
        else:
            waiter = slot.loaded.wait()  # a load already under way (on demand or by the admin API)
        self.load_waiters[name] = self.load_waiters.get(name, 0) + 1
        try:
            await asyncio.wait_for(waiter, cc.load_timeout_s)
        except asyncio.TimeoutError:
            raise ModelUnavailable(f"model {name} is still loading after {cc.load_timeout_s:.0f} s; retry shortly",
                                   code="model_loading", retry_after_s=5) from None
        finally:
            left = self.load_waiters.pop(name) - 1
            if left:
                self.load_waiters[name] = left
        if name not in self.slots and (full := self._device_full.get(name)) is not None:  # the device is full
            raise ModelUnavailable(str(full), code="device_full", retry_after_s=max(1, round(full.retry_after_s or 5)))

    def _watch_hit_rate(self, name: str, hit: bool) -> None:
        """A device hit rate under cache.hit_rate_alert over the last lookups publishes one
        `cache_hit_rate_low` event with a sizing suggestion (again only after it recovers)."""
        cc = self.config.cache
        alert = self.hit_rate.observe(name, hit, cc.hit_rate_alert, cc.cache_size)
        if alert is not None:
            log.warning("weight cache: %s", alert["message"])
            self.bus.publish(CacheHitRateLow(**alert))

    def _prefetch_after(self, name: str) -> None:
        """Warm the models likely to be asked for next when the device can take them without
        evicting anything busy or more likely to be used soon."""
        in_store = set(ModelStore().names())
        for nxt, p in self.predictor.next_models(name):
            if nxt in self.slots or nxt not in in_store or nxt in self._load_tasks and not self._load_tasks[nxt].done():
                continue
            busy = {n for n, s in self.slots.items() if s.num_in_flight or s.state != "ready"} | {name}
            try:
                evict = self._route(nxt, self.sources.weight_bytes(nxt), busy | self.sources.base_set(nxt)).evict
            except Exception:  # no room, or an unreadable model: no prefetch
                continue
            if any(self.predictor.value(e) >= p for e in evict):
                continue
            self.prefetch_stats.issued += 1
            self.prefetch_stats.pending.add(nxt)
            log.info("prefetching model %s (follows %s with p=%.2f)", nxt, name, p)
            self.bus.publish(Prefetch(model=nxt, after=name, probability=p))
            self._load_tasks[nxt] = asyncio.ensure_future(self._load_quietly(nxt))

    async def _load_quietly(self, name: str) -> None:
        try:
            await self.load(name)
        except Exception:  # the slot says failed, with the reason; the waiting requests read it
            pass

    # ---- load -------------------------------------------------------------------------------------
    async def load(self, name: str, pinned: bool = False) -> ModelSlot:
        """Load a model onto its own engine thread (or worker process), from the fastest tier that has
        it (host copy, INT8 file, store), evicting least recently used idle models first; returns
        when it serves (or failed)."""
        slot = self.slots.get(name)
        if slot is not None and slot.state in ("ready", "loading"):
            await slot.loaded.wait()
            return slot
        model_dir = ModelStore().path(name)  # ModelNotFound names the models in the store
        cfg = copy.deepcopy(self.config.engine)
        cfg.model = name
        slot = ModelSlot(name, cfg, pinned=pinned)
        self.slots[name] = slot
        self.bus.publish(ModelLoad(model=name, phase="start"))
        t0 = time.monotonic()
        try:
            base, config_dir = self.sources.variant_dirs(name, model_dir)  # a variant runs on its base's config
            slot.base = base
            if base is None and self.sources.wants_int8(name):
                await asyncio.to_thread(self._check_int8, name, model_dir, cfg)
            self.cache.claim(name)  # weights held for its variants stay while its engine is built
            slot.device = await self._make_room(name)  # the device it goes to
            if cfg.devices:  # several devices; with one, engine.device applies (reload too)
                cfg.device = torch_device(slot.device)
            isolation = self.sharing.isolation(cfg.isolation, slot.device, variant=base is not None)
            if isolation == "process" and base is not None:  # asked for by name (or mps), not by auto
                raise UserError(f"model {name} is a variant of {base}: it runs on its weights in the daemon's memory, "
                                "which an engine worker process cannot share; use engine.isolation: thread, not mps")
            handle = self.sharing.attach(name, slot.device, isolation)  # the plan is redone with it; its arbiter
        except Exception as exc:
            self._load_failed(slot, exc)
            raise
        on_layer = self._layer_reporter(slot)
        sources: list = []  # the weight source the engine thread chose (a variant's reports its delta bytes)
        loop: AnyEngineLoop | None = None
        seat = self.cpu_budget.seat_for(name, cfg.device, cfg.num_threads)  # its share of the cores per step
        try:
            if isolation == "process":
                loop = worker_loop(self, slot, cfg, model_dir, on_layer, seat)
            else:
                build = partial(self._build_engine, slot, cfg, model_dir, config_dir, on_layer, sources)
                loop = EngineLoop(name, build, asyncio.get_running_loop(), self.on_post, self.metrics,
                                  self.config.server.admission_window_ms / 1000, arbiter=handle,
                                  on_exit=partial(self.sharing.unbind, name), seat=seat)
            loop.start()
            await asyncio.wrap_future(loop.ready)
            facts = loop.facts()
            if isolation == "process":
                await worker_ready(self, slot, loop, facts)
            slot.tokenizer = await asyncio.to_thread(load_tokenizer, config_dir)
        except Exception as exc:
            if loop is not None:
                await asyncio.to_thread(loop.stop)
            self._load_failed(slot, exc)
            raise
        self._loaded(slot, loop, facts, base, isolation, time.monotonic() - t0, sources)
        if isolation == "process":
            if loop.exit is not None:  # it exited while the load was finishing, before the slot held it
                worker_exited(self, loop, {**loop.exit, "num_failed_requests": 0})
            return slot  # the worker reads the store: a host copy in the daemon would serve nobody
        if self.config.cache.host_bytes and not base and self.cache.residency(name)["host"] == 0:
            asyncio.ensure_future(asyncio.to_thread(self.sources.keep_host_copy, name, model_dir))
        return slot

    def _check_int8(self, name: str, model_dir: Path, cfg) -> None:
        """int8 only for a model whose INT8 weights keep its answers (engine/agreement.py): otherwise it is
        refused, with the numbers, and the model is served at full precision."""
        try:
            why = int8_verdict(name, model_dir, cfg, self.config.cache.int8_min_agreement)
        except Exception as exc:  # the full-precision weights still serve
            why = f"int8 refused for {name}: its agreement could not be measured ({exc})"
        self.sources.refuse_int8(name, why)
        if why is not None:
            log.warning("%s", why)

    def _layer_reporter(self, slot: ModelSlot) -> Callable[[int, float], None]:
        """on_layer for a layered load: called on the engine thread as each layer lands."""
        aloop = asyncio.get_running_loop()

        def on_layer(i: int, seconds: float) -> None:
            slot.layers_ready = i + 1
            aloop.call_soon_threadsafe(self.bus.publish, ModelLoad(
                model=slot.name, device=slot.device, phase="layer", layer=i, layers_loaded=i + 1,
                num_layers=slot.num_layers, layer_s=seconds))

        return on_layer

    def _build_engine(self, slot: ModelSlot, cfg, model_dir: Path, config_dir: Path, on_layer, sources: list):
        """On the engine thread: its SM partition, its weight source, then the engine."""
        name = slot.name
        if cfg.device.startswith("cuda"):  # this thread's current device: streams and kernels go there
            import torch  # only a CUDA build reaches here; torch is loaded by then, the import is a lookup

            torch.cuda.set_device(torch.device(cfg.device))
        self.sharing.bind(name)  # its SM partition, on this (the engine) thread, before any allocation
        source, tier = self.sources.weight_source(name, model_dir)
        sources.append(source)
        slot.source_tier = tier
        slot.num_layers = load_arch(config_dir).num_layers
        cc = self.config.cache
        initial = cc.initial_layers if cc.load_strategy == "layered" else None
        engine = make_engine(name, config_dir, cfg, source, initial, on_layer, self.quotas)
        self.sharing.loaded(name, engine)  # its memory quota caps its KV pool
        return engine

    def _loaded(self, slot: ModelSlot, loop: AnyEngineLoop, facts: EngineFacts, base: str | None, isolation: str,
                took: float, sources: list) -> None:
        """The engine serves: the slot goes ready, the cache and the readers learn of it."""
        name = slot.name
        slot.max_model_len = facts.max_model_len
        if self.metrics is not None:
            self.metrics.add_model(name)
        slot.loop = loop
        slot.state, slot.last_active = "ready", time.monotonic()  # its keep_alive counts from when it serves
        slot.loaded.set()
        slot.weights_bytes = facts.weights_bytes  # a variant's: its delta alone
        self.cache.device_loaded(name, slot.weights_bytes, slot.pinned, base=base, device=slot.device)
        self._load_failed_at.pop(name, None), self._device_full.pop(name, None)
        delta_read = getattr(sources[0], "bytes_read", 0) if base else 0
        if base:
            self.cache.bytes_loaded["delta"] = self.cache.bytes_loaded.get("delta", 0) + delta_read
            log.info("model %s is %s plus a %s delta: %d bytes read for the delta", name, base,
                     sources[0].spec.kind, delta_read)
        log.info("model %s ready on %s in %.1f s from the %s tier (%d KV blocks of %d tokens, context %d)%s", name,
                 slot.device, took, slot.source_tier, facts.num_kv_blocks, slot.config.block_size,
                 facts.max_model_len, f" in engine worker process {loop.pid}" if loop.pid else "")
        self.bus.publish(ModelLoad(model=name, device=slot.device, phase="ready", load_s=took, tier=slot.source_tier,
                                   num_layers=slot.num_layers, isolation=isolation, worker_pid=loop.pid or None,
                                   base=base or None, delta_bytes_read=delta_read if base else None))

    def _load_failed(self, slot: ModelSlot, exc: BaseException) -> None:
        if slot.name in self.sharing.names:
            self.sharing.detach(slot.name)
        slot.state = "failed"
        slot.error = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
        slot.loaded.set()
        if isinstance(exc, CacheFull):  # no broken model, a full device: the next request tries again (a 503)
            self.slots.pop(slot.name, None)
            self._device_full[slot.name] = exc
        else:
            self._load_failed_at[slot.name] = time.monotonic()
        self.cache.device_evicted(slot.name)
        log.error("model %s failed to load: %s", slot.name, slot.error, exc_info=not isinstance(exc, UserError))
        self.bus.publish(ModelLoad(model=slot.name, phase="failed", device=slot.device or None, error=slot.error))

    # ---- placement: devices and eviction ----------------------------------------------------------
    async def _make_room(self, name: str) -> str:
        """Pick the device for `name` and evict least recently used idle models there until it
        fits that device's tier; returns the device."""
        need = await asyncio.to_thread(self.sources.weight_bytes, name)
        busy = {n for n, s in self.slots.items() if n != name and (s.num_in_flight or s.state != "ready")}
        busy |= self.sources.base_set(name)  # a variant runs on its base's weights
        plan = self._route(name, need, busy)
        self.cache.reserve(name, plan.device, need)  # a concurrent load sees these bytes taken
        if len(self.devices) > 1:
            log.info("model %s goes to %s (%s)", name, plan.device,
                     f"evicting {', '.join(plan.evict)}" if plan.evict else "no eviction")
        for victim in plan.evict:
            log.info("evicting model %s from the device to make room for %s", victim, name)
            if victim in self.prefetch_stats.pending:
                self.prefetch_stats.pending.discard(victim)
                self.prefetch_stats.wasted += 1
            self.bus.publish(ModelEvict(model=victim, for_model=name, device=plan.device,
                                        to_tier="host" if self.cache.residency(victim)["host"] else "disk"))
            await self.unload(victim, timeout=0, reason="evicted")
        return plan.device

    def device_load(self) -> dict[str, int]:
        """Per device: requests in flight and queued on its models, plus loads under way there."""
        load = {d: 0 for d in self.devices}
        for s in self.slots.values():
            if s.device in load:
                load[s.device] += s.num_in_flight + (s.state == "loading")
        return load

    def _route(self, name: str, need: int, busy: set[str]):
        """The device `name` loads on and whom it evicts there (a DevicePlan): the device that already
        holds its weights (or its base's), else routing.choose_device over every device's plan.
        UserError when it can never fit; CacheFull when no device can make room now."""
        base = self.sources.base_of(name)
        resident = self.cache.device_of(name) or (self.cache.device_of(base) if base else None)
        return pick_plan(self.cache.plan_options(name, need, busy, kept=self.kept_for()), resident, self.device_load())

    # ---- unload, pin, versions --------------------------------------------------------------------
    async def unload(self, name: str, timeout: float | None = None, force: bool = False,
                     reason: str = "asked") -> dict:
        """Stop admitting for the model, let its requests finish (up to timeout), abort the rest, free it."""
        slot = self.slot(name)
        if slot.pinned and not force:
            raise ModelPinned(f"model {name} is pinned; unpin it first (gpuserv models pin {name} --off)", "model")
        if slot.state == "loading":
            await slot.loaded.wait()
        slot.state = "unloading"
        timeout = self.config.server.drain_timeout if timeout is None else timeout
        finished, aborted = await self._end_requests(slot, timeout)
        if slot.loop is not None:
            await asyncio.to_thread(slot.loop.stop)
            replenish_spare(self, slot.loop)
        slot.encoder.shutdown(wait=False)
        self.slots.pop(name, None)
        if self.metrics is not None:
            self.metrics.remove_model(name)
        self.sharing.detach(name)
        self.cpu_budget.release(name)  # its slot goes to the next model loaded
        self.cache.device_evicted(name)
        self.bus.publish(ModelUnload(model=name, device=slot.device or None, num_aborted=aborted, reason=reason))
        log.info("model %s unloaded (%d requests finished, %d aborted)", name, finished, aborted)
        return {"model": name, "num_finished": finished, "num_aborted": aborted}

    # -- keep_alive: an idle model leaves the device by itself, and is not evicted before ----------------
    def keep_alive_s(self, slot: ModelSlot) -> float:
        """Its last request's keep_alive, else cache.keep_alive_s (negative: never leaves by itself)."""
        return self.config.cache.keep_alive_s if slot.keep_alive_s is None else slot.keep_alive_s

    def kept_for(self) -> dict[str, float]:
        """Model -> seconds its keep_alive still guards it from eviction (idle from its last request's end)."""
        ka = {n: self.keep_alive_s(v) for n, v in self.slots.items()}
        return {n: self.slots[n].last_active + k - time.monotonic() for n, k in ka.items() if k > 0}

    def unload_in_s(self, slot: ModelSlot, now: float | None = None) -> float | None:
        """Seconds until an idle model leaves by itself; None while it works, is pinned, or stays forever."""
        ka = self.keep_alive_s(slot)
        if ka < 0 or slot.pinned or slot.state != "ready" or slot.num_in_flight or slot.num_queued \
                or self.load_waiters.get(slot.name):  # requests that waited for its load are not admitted yet
            return None
        return max(0.0, slot.last_active + ka - (time.monotonic() if now is None else now))

    async def keep_alive_loop(self, period_s: float = 0.25) -> None:
        """Unload (down a tier: the host copy stays) every model idle past its keep_alive; until cancelled."""
        while True:
            await asyncio.sleep(period_s)
            now = time.monotonic()
            for name, slot in list(self.slots.items()):
                if self.unload_in_s(slot, now) == 0.0:
                    log.info("model %s idle for %.1f s (keep_alive %.1f s): unloading it", name,
                             now - slot.last_active, self.keep_alive_s(slot))
                    try:
                        await self.unload(name, timeout=0, reason="keep_alive")
                    except Exception:  # pinned meanwhile, or already gone: the next tick looks again
                        log.exception("keep_alive could not unload model %s", name)

    def pin(self, name: str, pinned: bool) -> dict:
        slot = self.slot(name)
        slot.pinned = pinned
        self.cache.set_pinned(name, pinned)
        self.bus.publish(ModelPin(model=name, pinned=pinned))
        return {"model": name, "pinned": pinned}

    def set_versions(self, alias: str, weights: dict | None) -> dict:
        """Change an alias's version weights at run time (admin API, reload)."""
        try:
            return self.router.set(alias, weights)
        except UserError as exc:
            raise InvalidRequest(str(exc), "weights") from None

    async def reset_prefix_cache(self, name: str) -> int:
        """Forget a ready model's cached prefix blocks (between its steps); returns how many."""
        slot = self.slots.get(name)
        if slot is None or slot.loop is None or slot.state != "ready":
            raise ModelNotServed(f"model {name} is not loaded", "model")
        return await asyncio.wrap_future(slot.loop.call(partial(reset_prefix_cache)))

    async def stop_engines(self) -> None:
        for slot in list(self.slots.values()):
            if slot.loop is not None:
                await asyncio.to_thread(slot.loop.stop)
            slot.encoder.shutdown(wait=False)
        if self.spare is not None:
            await asyncio.to_thread(self.spare.close)
        self.sharing.close()

    # ---- status -----------------------------------------------------------------------------------
    def model_status(self, slot: ModelSlot) -> ModelStatus:
        snap = slot.loop.snapshot if slot.loop is not None else None
        return ModelStatus(
            name=slot.name, state=slot.state, pinned=slot.pinned, device=slot.device or slot.config.device,
            kv_blocks_total=snap.kv_blocks_total if snap else 0,
            kv_blocks_free=(snap.kv_blocks_total - snap.kv_blocks_used) if snap else 0,
            kv_block_size=slot.config.block_size, num_running=snap.num_running if snap else 0,
            num_waiting=snap.num_waiting if snap else 0, num_in_flight=slot.num_in_flight,
            max_model_len=slot.max_model_len, num_steps=snap.num_steps if snap else 0, error=slot.error,
            preemption=snap.preemption if snap else None, decode=snap.decode if snap else None,
            prefix_cache=snap.prefix_cache if snap else None, tiers=self.cache.residency(slot.name),
            weights_bytes=slot.weights_bytes, num_layers=slot.num_layers, layers_ready=slot.layers_ready,
            source_tier=slot.source_tier, compression=self.sources.compression_for(slot.name),
            keep_alive_s=self.keep_alive_s(slot), unload_in_s=self.unload_in_s(slot),
            compression_refused=self.sources.refused.get(slot.name), **self.sharing.model_fields(slot.name))

    def status_sections(self) -> dict:
        """The model side of /admin/status: device readings, partitions, quotas, versions, weight cache."""
        eng = self.config.engine  # engine.dtype auto: what it chose for this device, and why
        data: dict = {"device": {**self.device, "readings": self.sharing.readings,
                                 "dtype": eng.dtype, "dtype_reason": eng.dtype_reason}}
        sharing = self.sharing.status()  # backend: the partition backend and its one-line summary
        data.update(sharing=sharing["backend"], **{k: sharing[k] for k in ("partitions", "quotas", "arbiter")})
        data["versions"] = self.router.status()
        data["weight_cache"] = self.cache.status()
        load = self.device_load()  # per device its tier (budget, bytes, models) and its load
        tiers = data["weight_cache"].pop("devices")
        data["devices"] = {d: {**tier, "load": load.get(d, 0)} for d, tier in tiers.items()}
        data["weight_cache"]["prefetch"] = {"enabled": self.config.cache.prefetch, **self.prefetch_stats.to_dict()}
        return data

    async def engine_views(self) -> dict[str, dict]:
        """Request id -> the engine's view of it (state, tokens, preemptions), over every live engine."""
        views: dict[str, dict] = {}
        for slot in list(self.slots.values()):
            if slot.loop is None or not slot.loop.alive:
                continue
            try:
                views.update(await asyncio.wrap_future(slot.loop.call(request_views)))
            except RuntimeError:  # its worker process exited meanwhile: its requests are failing
                continue
        return views

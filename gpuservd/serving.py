"""What the HTTP layer serves: the loaded models, admission control, request streams, drain.

Runs on the event loop; each model's engine runs on its own EngineLoop thread.
Admission (MISSION S8, O4) is decided here before a request reaches an engine:
draining -> 503, unknown model -> 404, a full per-model or per-tenant queue ->
429 with Retry-After. A request counts as *queued* from admission until its
first token, and as *in flight* until its last.

Devices (M8): `engine.devices` lists the daemon's devices (empty = the one
`engine.device`). Every slot carries the device it runs on; a request for a
model resident on a device goes there (a hit), and a load goes to the device
`routing.choose_device` picks from the weight cache's per-device plans (no
eviction first, then fewer bytes and models to evict, then the lighter load,
then the lower index). A model runs on one device at a time; a variant runs
where its base's weights are.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections import deque
from dataclasses import asdict

from gpuservd import __version__
from gpuservd.api import protocol
from gpuservd.api.protocol import APIError, GenerationRequest
from gpuservd.api.status import DaemonStatus, ModelStatus
from gpuservd.daemon_config import DaemonConfig
from gpuservd.engine_loop import Accepted, EngineGone, EngineLoop, Failed, Submission
from gpuservd.errors import UserError
from gpuservd.events import EventBus
from gpuservd.request_stream import ActiveRequest, ModelSlot, RequestContext, engine_gone
from gpuservd.tenants import TenantMap

log = logging.getLogger("gpuservd.serving")
LOAD_RETRY_S = 10.0  # a model whose load failed is tried again on demand after this long
HIT_WINDOW = 50  # requests the hit-rate alert looks back over
access_log = logging.getLogger("gpuservd.access")


class Serving:
    """Models, admission and request streams; the HTTP routes call into this."""

    def __init__(self, config: DaemonConfig, tenants: TenantMap, metrics=None, bus: EventBus | None = None,
                 device: dict | None = None):
        self.config = config
        self.tenants = tenants
        self.metrics = metrics  # api.metrics.Metrics (None in some tests)
        self.bus = bus or EventBus(config.server.event_queue_size)
        self.device = device or {"backend": "cpu"}
        self.slots: dict[str, ModelSlot] = {}
        self.active: dict[str, ActiveRequest] = {}
        self.tenant_queued: dict[str, int] = {}
        self.tenant_in_flight: dict[str, int] = {}
        self.state = "starting"  # starting | serving | draining
        self.started = time.monotonic()
        self.num_requests_total = 0
        self.num_rejected_total = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_task: asyncio.Task | None = None
        self.socket: str | None = None  # set by the daemon for /admin/status
        self.tcp: str | None = None
        from gpuservd.weights.cache import WeightCache

        self.devices = config.engine.device_names()  # M8: [engine.device] unless engine.devices lists several
        self.cache = WeightCache(config.cache, config.engine.device_memory_bytes, self.devices)
        self._load_failed_at: dict[str, float] = {}  # model -> monotonic time its last load failed
        self._load_tasks: dict[str, asyncio.Future] = {}  # on-demand loads in progress
        from gpuservd.weights.prefetch import PrefetchStats, Predictor

        from gpuservd.routing import VersionRouter

        self.router = VersionRouter(config.server.versions)
        self.predictor = Predictor(min_prob=config.cache.prefetch_min_prob)
        self.prefetch_stats = PrefetchStats()
        self._lookups: deque[tuple[str, bool]] = deque(maxlen=HIT_WINDOW)  # (model, found on the device)
        self._hit_alert_on = False
        from gpuservd.sharing.manager import SharingManager

        self.sharing = SharingManager(config, self.device)  # backend, plan, arbiter, quotas, readings (G1-G5)
        from gpuservd.hints.monitor import HintMonitor

        self.hints = HintMonitor()  # sees every event; the daemon runs its once-a-second evaluation
        self.bus.taps.append(self.hints.observe)

    # ---- admission --------------------------------------------------------------------------------

    def set_tenants(self, tenants: TenantMap) -> None:
        """New tenants (reload): identity and queue limits at once, engine quotas between steps."""
        self.tenants = tenants
        from functools import partial

        from gpuservd.engine_calls import set_tenant_quotas

        quotas = tenants.quotas()
        for slot in self.slots.values():
            if slot.loop is not None and slot.loop.alive:
                slot.loop.call(partial(set_tenant_quotas, quotas))

    def reject(self, reason: str) -> None:
        self.num_rejected_total += 1
        if self.metrics is not None:
            self.metrics.rejected(reason)

    def model_names(self, ready_only: bool = True) -> list[str]:
        return sorted(n for n, s in self.slots.items() if s.state == "ready" or not ready_only)

    def _admit(self, greq: GenerationRequest, ctx: RequestContext) -> ModelSlot:
        if self.state == "draining":
            self.reject("draining")
            raise protocol.unavailable("the daemon is draining and admits no new requests", "draining")
        slot = self.slots.get(greq.model)
        if slot is None or slot.state == "failed":
            self.reject("model_not_found")
            failed = "failed" if slot and slot.worker_exit else "failed to load"
            hint = f" ({greq.model} {failed}: {slot.error})" if slot else ""
            raise protocol.model_not_found(greq.model, self.model_names(), hint)
        if slot.state != "ready":
            self.reject(slot.state)
            raise protocol.unavailable(f"model {greq.model} is {slot.state}; retry shortly", f"model_{slot.state}", 5)
        limit = self.config.server.max_queued_per_model
        if slot.num_queued >= limit:
            self.reject("queue_full")
            raise protocol.rate_limited(f"model {greq.model} has {slot.num_queued} requests waiting (limit {limit}); "
                                        "retry later", slot.retry_after_s())
        t = ctx.tenant
        tlimit = t.max_queued or self.config.server.max_queued_per_tenant
        if self.tenant_queued.get(t.name, 0) >= tlimit:
            self.reject("tenant_queue_full")
            raise protocol.rate_limited(f"tenant {t.name} has {self.tenant_queued[t.name]} requests waiting "
                                        f"(limit {tlimit}); retry later", slot.retry_after_s())
        if t.max_in_flight and self.tenant_in_flight.get(t.name, 0) >= t.max_in_flight:
            self.reject("tenant_in_flight")
            raise protocol.rate_limited(f"tenant {t.name} has {t.max_in_flight} unfinished requests (its limit); "
                                        "retry later", slot.retry_after_s())
        return slot

    def _encode(self, slot: ModelSlot, greq: GenerationRequest) -> list[int]:
        """Token ids of the prompt (runs on the model's encoder thread)."""
        from gpuservd.engine.tokenizer import encode_chat, encode_raw

        if greq.kind == "chat":
            return encode_chat(slot.tokenizer, greq.messages)
        if greq.prompt_token_ids is not None:
            return greq.prompt_token_ids
        return encode_raw(slot.tokenizer, greq.prompt)

    def _sampling(self, greq: GenerationRequest, num_prompt_tokens: int, slot: ModelSlot):
        from gpuservd.engine.request import SamplingParams

        max_tokens = greq.max_tokens
        if max_tokens is None:  # chat without a limit: the rest of the context, as vLLM does
            max_tokens = slot.max_model_len - num_prompt_tokens
            if max_tokens < 1:
                raise protocol.bad_request(f"the messages take {num_prompt_tokens} tokens and fill the context "
                                           f"length {slot.max_model_len}; shorten them", "messages")
        return SamplingParams(max_tokens=max_tokens, temperature=greq.temperature, top_k=greq.top_k,
                              top_p=greq.top_p, seed=greq.seed, stop=list(greq.stop), ignore_eos=greq.ignore_eos,
                              detokenize=greq.detokenize)

    async def _ensure_loaded(self, name: str) -> None:
        """Load on demand (M2): a request for a store model that is not on the device starts its load,
        and every request for it waits on that one load; other models keep serving meanwhile."""
        cc = self.config.cache
        slot = self.slots.get(name)
        on_device = slot is not None and slot.state == "ready"
        self.cache.touch(name)
        if name in self.prefetch_stats.pending:  # its load was started ahead of this request
            warmed = slot is not None and slot.state in ("ready", "loading")
            self.prefetch_stats.pending.discard(name)
            self.prefetch_stats.used += warmed
            self.prefetch_stats.wasted += not warmed
        self.predictor.observe(name)
        self._watch_hit_rate(name, on_device)
        if cc.prefetch and self.state != "draining":
            self._prefetch_after(name)
        if on_device or self.state == "draining":
            return
        if slot is None or slot.state == "failed":
            if not cc.load_on_demand or time.monotonic() - self._load_failed_at.get(name, -1e9) < LOAD_RETRY_S:
                return  # _admit answers (404 naming the failure, until it may be retried)
            from gpuservd.store.store import ModelStore

            if name not in ModelStore().names():
                return  # _admit answers 404 with the models there are
            task = self._load_tasks.get(name)
            if task is None or task.done():  # one load, however many requests wait on it (M8)
                task = self._load_tasks[name] = asyncio.ensure_future(self._load_quietly(name))
            waiter = asyncio.shield(task)
        else:
            waiter = slot.loaded.wait()  # a load already under way (on demand or by the admin API)
        try:
            await asyncio.wait_for(waiter, cc.load_timeout_s)
        except asyncio.TimeoutError:
            raise protocol.unavailable(f"model {name} is still loading after {cc.load_timeout_s:.0f} s; "
                                       "retry shortly", "model_loading", 5) from None

    def _watch_hit_rate(self, name: str, hit: bool) -> None:
        """M9: over the last HIT_WINDOW lookups, a device hit rate under cache.hit_rate_alert publishes
        one `cache_hit_rate_low` event with a sizing suggestion (again only after it recovers)."""
        self._lookups.append((name, hit))
        if len(self._lookups) < HIT_WINDOW:
            return
        rate = sum(h for _, h in self._lookups) / len(self._lookups)
        if rate >= self.config.cache.hit_rate_alert:
            self._hit_alert_on = False
            return
        if self._hit_alert_on:
            return
        self._hit_alert_on = True
        counts: dict[str, int] = {}
        for m, _ in self._lookups:
            counts[m] = counts.get(m, 0) + 1
        need, covered = 0, 0
        for c in sorted(counts.values(), reverse=True):  # models that carry 90% of the requests
            need, covered = need + 1, covered + c
            if covered >= 0.9 * len(self._lookups):
                break
        cc = self.config.cache
        suggestion = (f"the device hit rate is {100 * rate:.0f}% over the last {len(self._lookups)} requests "
                      f"(alert below {100 * cc.hit_rate_alert:.0f}%); {need} models carry 90% of them and "
                      f"cache.cache_size is {cc.cache_size}: raise cache_size to {max(need, cc.cache_size + 1)} "
                      "(with the device bytes to match), pin the busiest models, or turn prefetch on")
        log.warning("weight cache: %s", suggestion)
        self.bus.publish({"type": "cache_hit_rate_low", "t": time.time(), "hit_rate": rate,
                          "window": len(self._lookups), "models_for_90pct": need, "cache_size": cc.cache_size,
                          "suggested_cache_size": max(need, cc.cache_size + 1), "message": suggestion})

    def _prefetch_after(self, name: str) -> None:
        """Warm the models likely to be asked for next (M3) when the device can take them without
        evicting anything busy or more likely to be used soon."""
        from gpuservd.store.store import ModelStore

        in_store = set(ModelStore().names())
        for nxt, p in self.predictor.next_models(name):
            if nxt in self.slots or nxt not in in_store or nxt in self._load_tasks and not self._load_tasks[nxt].done():
                continue
            busy = {n for n, s in self.slots.items() if s.num_in_flight or s.state != "ready"} | {name}
            try:
                evict = self._route(nxt, self._weight_bytes(nxt), busy | self._base_set(nxt)).evict
            except Exception:  # no room, or an unreadable model: no prefetch
                continue
            if any(self.predictor.value(e) >= p for e in evict):
                continue
            self.prefetch_stats.issued += 1
            self.prefetch_stats.pending.add(nxt)
            log.info("prefetching model %s (follows %s with p=%.2f)", nxt, name, p)
            self.bus.publish({"type": "prefetch", "t": time.time(), "model": nxt, "after": name, "probability": p})
            self._load_tasks[nxt] = asyncio.ensure_future(self._load_quietly(nxt))

    async def _load_quietly(self, name: str) -> None:
        try:
            await self.load(name)
        except Exception:  # the slot says failed, with the reason; the waiting requests read it
            pass

    async def start(self, greq: GenerationRequest, ctx: RequestContext) -> ActiveRequest:
        """Admit, tokenize and queue a request; returns once the engine accepted it (else raises APIError)."""
        greq.model = self.router.pick(greq.model)  # a versioned name: the version that serves it (O4)
        await self._ensure_loaded(greq.model)
        slot = self._admit(greq, ctx)
        active = ActiveRequest(self, slot, ctx, greq)
        tname = ctx.tenant.name
        slot.num_queued += 1
        slot.num_in_flight += 1
        self.tenant_queued[tname] = self.tenant_queued.get(tname, 0) + 1
        self.tenant_in_flight[tname] = self.tenant_in_flight.get(tname, 0) + 1
        self.active[ctx.request_id] = active
        self._idle.clear()
        self.num_requests_total += 1
        submitted = False
        try:
            try:
                ids = greq.prompt_token_ids if greq.prompt_token_ids is not None else \
                    await asyncio.get_running_loop().run_in_executor(slot.encoder, self._encode, slot, greq)
            except UserError as exc:
                raise protocol.bad_request(str(exc), "messages" if greq.kind == "chat" else "prompt") from None
            active.num_prompt_tokens = len(ids)
            if self.bus.wants("request_prompt"):  # `gpuserv record --with-prompts` is listening
                self._publish_prompt(slot, greq, ctx, ids)
            params = self._sampling(greq, len(ids), slot)
            priority = ctx.tenant.effective_priority(greq.priority)
            if slot.loop is None or slot.state != "ready":
                raise protocol.unavailable(f"model {greq.model} is {slot.state}; retry shortly", "model_unavailable", 5)
            slot.loop.submit(Submission(ctx.request_id, ids, params, active.sink, priority, tname, ctx.arrival))
            submitted = True
            first = await active.sink.queue.get()
            if isinstance(first, EngineGone):
                raise engine_gone(first)
            if isinstance(first, Failed):
                if first.internal:
                    raise protocol.internal_error(ctx.request_id)
                msg = str(first.error)
                param = "max_tokens" if "max_tokens" in msg else ("prompt" if greq.kind == "completion" else "messages")
                raise protocol.bad_request(msg, param, "context_length_exceeded" if "context" in msg else "invalid_value")
            if not isinstance(first, Accepted):  # an abort raced the acceptance (drain): hand the output back
                active.sink.queue.put_nowait(first)
            return active
        except BaseException as exc:
            if submitted and not isinstance(exc, APIError) and slot.loop is not None:
                slot.loop.abort(ctx.request_id)  # cancelled while queued: drop it from the engine
            active.done = True
            active.status = exc.status if isinstance(exc, APIError) else 500
            if isinstance(exc, APIError):
                self.reject("bad_request" if exc.status == 400 else f"http_{exc.status}")
            active.close()
            raise

    def _release(self, active: ActiveRequest) -> None:
        slot, ctx = active.slot, active.ctx
        slot.num_in_flight -= 1
        self.tenant_in_flight[ctx.tenant.name] -= 1
        self.active.pop(ctx.request_id, None)
        if not self.active:
            self._idle.set()
        now = time.monotonic()
        if active.status == 200:
            slot.finish_times.append(now)
        ttft = (active.first_token_at - ctx.arrival) if active.first_token_at else None
        event = {"type": "request_finished", "t": time.time(), "model": slot.name, "request_id": ctx.request_id,
                 "tenant": ctx.tenant.name, "uid": ctx.uid, "status": active.status,
                 "finish_reason": active.finish_reason, "num_prompt_tokens": active.num_prompt_tokens,
                 "num_output_tokens": active.num_output_tokens, "ttft_s": ttft, "e2e_s": now - ctx.arrival,
                 "priority": ctx.tenant.effective_priority(active.greq.priority),
                 "arrival_t": time.time() - (now - ctx.arrival)}
        self.bus.publish(event)
        if self.config.server.log_requests:
            access_log.info(
                "%s %s uid=%s pid=%s tenant=%s model=%s status=%s finish=%s prompt=%d output=%d ttft_ms=%s e2e_ms=%.1f",
                ctx.request_id, ctx.via, ctx.uid, ctx.pid, ctx.tenant.name, slot.name, active.status,
                active.finish_reason, active.num_prompt_tokens, active.num_output_tokens,
                f"{ttft * 1000:.1f}" if ttft is not None else "-", (now - ctx.arrival) * 1000)

    def _publish_prompt(self, slot: ModelSlot, greq: GenerationRequest, ctx: RequestContext, ids: list[int]) -> None:
        """The prompt as text (chat: the rendered template), for a recorder that asked for prompts."""
        text = greq.prompt if isinstance(greq.prompt, str) and greq.kind == "completion" else \
            slot.tokenizer.decode(ids, skip_special_tokens=False)
        self.bus.publish({"type": "request_prompt", "t": time.time(), "model": slot.name,
                          "request_id": ctx.request_id, "prompt": text})

    def on_post(self, deliveries: list, events: list) -> None:
        """From an engine thread, once per iteration: outputs to their requests, events to readers."""
        for sink, item in deliveries:
            sink.put(item)
        for event in events:
            self.bus.publish(event)

    # ---- models -----------------------------------------------------------------------------------
    async def load(self, name: str, pinned: bool = False) -> ModelSlot:
        """Load a model onto its own engine thread, from the fastest tier that has it (host copy,
        INT8 file, store), evicting least recently used idle models first (M7); returns when it
        serves (or failed)."""
        slot = self.slots.get(name)
        if slot is not None and slot.state in ("ready", "loading"):
            await slot.loaded.wait()
            return slot
        from gpuservd.store.store import ModelStore

        model_dir = ModelStore().path(name)  # ModelNotFound names the models in the store
        cfg = copy.deepcopy(self.config.engine)
        cfg.model = name
        slot = ModelSlot(name, cfg, pinned=pinned)
        self.slots[name] = slot
        self.bus.publish({"type": "model_load", "t": time.time(), "model": name, "phase": "start"})
        t0 = time.monotonic()
        try:
            base, config_dir = self._variant_dirs(name, model_dir)  # a variant (M6) runs on its base's config
            self.cache.claim(name)  # weights held for its variants stay while its engine is built
            slot.device = await self._make_room(name, model_dir, cfg)  # M8: the device it goes to
            if cfg.devices:  # several devices (M8); with one, engine.device applies as before (reload too)
                from gpuservd.config import torch_device

                cfg.device = torch_device(slot.device)
        except Exception as exc:
            self._load_failed(slot, exc)
            raise
        from gpuservd.engine.tokenizer import load_tokenizer

        cc = self.config.cache
        aloop = asyncio.get_running_loop()

        def on_layer(i: int, seconds: float) -> None:  # the engine thread, as each layer lands
            slot.layers_ready = i + 1
            aloop.call_soon_threadsafe(self.bus.publish, {
                "type": "model_load", "t": time.time(), "model": name, "device": slot.device, "phase": "layer",
                "layer": i, "layers_loaded": i + 1, "num_layers": slot.num_layers, "layer_s": seconds})

        sources = []
        isolation = self.sharing.isolation(cfg.isolation)  # process: an engine worker process (mps: always)
        try:
            if isolation == "process" and base is not None:
                raise UserError(f"model {name} is a variant of {base}: it runs on {base}'s weights in the daemon's "
                                "memory (M6), which an engine worker process cannot share; load it with "
                                "engine.isolation: thread (and a sharing.backend other than mps)")
            handle = self.sharing.attach(name, slot.device, isolation)  # the plan is redone with it; its arbiter
        except Exception as exc:
            self._load_failed(slot, exc)
            raise

        def build():
            from gpuservd.worker.build import make_engine

            if cfg.device.startswith("cuda"):  # this thread's current device: streams and kernels go there
                import torch

                torch.cuda.set_device(torch.device(cfg.device))
            self.sharing.bind(name)  # its SM partition, on this (the engine) thread, before any allocation
            source, tier = self._weight_source(name, model_dir)
            sources.append(source)
            slot.source_tier = tier
            from gpuservd.runner.model_config import load_arch

            slot.num_layers = load_arch(config_dir).num_layers
            initial = cc.initial_layers if cc.load_strategy == "layered" else None
            engine = make_engine(name, config_dir, cfg, source, initial, on_layer, self.tenants.quotas())
            self.sharing.loaded(name, engine)  # its memory quota caps its KV pool (G3)
            return engine

        loop = None
        try:
            if isolation == "process":
                loop = self._worker_loop(slot, cfg, model_dir, on_layer)
            else:
                loop = EngineLoop(name, build, aloop, self.on_post,
                                  self.metrics, self.config.server.admission_window_ms / 1000, arbiter=handle,
                                  on_exit=lambda: self.sharing.unbind(name))
            loop.start()
            await asyncio.wrap_future(loop.ready)
            facts = loop.facts()
            if isolation == "process":
                await self._worker_ready(slot, loop, facts)
            slot.tokenizer = await asyncio.to_thread(load_tokenizer, config_dir)
        except Exception as exc:
            if loop is not None:
                await asyncio.to_thread(loop.stop)
            self._load_failed(slot, exc)
            raise
        slot.max_model_len = facts.max_model_len
        if self.metrics is not None:
            self.metrics.add_model(name)
        slot.loop = loop
        slot.state = "ready"
        slot.loaded.set()
        slot.weights_bytes = facts.weights_bytes  # a variant's: its delta alone
        self.cache.device_loaded(name, slot.weights_bytes, pinned, base=base, device=slot.device)
        self._load_failed_at.pop(name, None)
        took = time.monotonic() - t0
        delta_read = getattr(sources[0], "bytes_read", 0) if base else 0
        if base:
            self.cache.bytes_loaded["delta"] = self.cache.bytes_loaded.get("delta", 0) + delta_read
            log.info("model %s is %s plus a %s delta: %d bytes read for the delta", name, base,
                     sources[0].spec.kind, delta_read)
        log.info("model %s ready on %s in %.1f s from the %s tier (%d KV blocks of %d tokens, context %d)%s", name,
                 slot.device, took, slot.source_tier, facts.num_kv_blocks, cfg.block_size, facts.max_model_len,
                 f" in engine worker process {loop.pid}" if loop.pid else "")
        self.bus.publish({"type": "model_load", "t": time.time(), "model": name, "device": slot.device,
                          "phase": "ready", "load_s": took,
                          "tier": slot.source_tier, "num_layers": slot.num_layers, "isolation": isolation,
                          **({"worker_pid": loop.pid} if loop.pid else {}),
                          **({"base": base, "delta_bytes_read": delta_read} if base else {})})
        if isolation == "process":
            if loop.exit is not None:  # it exited while the load was finishing, before the slot held it
                self._worker_exited(loop, {**loop.exit, "num_failed_requests": 0})
            return slot  # the worker reads the store: a host copy in the daemon would serve nobody
        if cc.host_bytes and not base and self.cache.residency(name)["host"] == 0:
            asyncio.ensure_future(asyncio.to_thread(self._keep_host_copy, name, model_dir))
        return slot

    def _worker_loop(self, slot: ModelSlot, cfg, model_dir, on_layer):
        """A WorkerLoop for the slot's model: its engine in a worker process, with the environment the
        partition backend gives it (MPS: its SM percentage and memory limit)."""
        from gpuservd.runner.model_config import load_arch
        from gpuservd.worker.build import WorkerSpec
        from gpuservd.worker.proxy import WorkerLoop

        env = self.sharing.worker_env(slot.name)
        wcfg = copy.deepcopy(cfg)
        if "CUDA_VISIBLE_DEVICES" in env:  # the worker sees its one GPU as device 0
            wcfg.device = "cuda:0"
        slot.num_layers = load_arch(model_dir).num_layers
        cc, srv = self.config.cache, self.config.server
        spec = WorkerSpec(slot.name, str(model_dir), str(model_dir), wcfg, cc.compression,
                          cc.initial_layers if cc.load_strategy == "layered" else None, self.tenants.quotas(),
                          srv.admission_window_ms / 1000, srv.log_level)
        return WorkerLoop(slot.name, spec, asyncio.get_running_loop(), self.on_post, self.metrics, env, on_layer,
                          self._worker_exited)

    async def _worker_ready(self, slot: ModelSlot, loop, facts) -> None:
        """A worker's engine is built: its memory quota caps its KV pool (G3), the store bytes it read count."""
        from functools import partial

        from gpuservd.engine_calls import set_kv_limit

        self.sharing.worker_started(slot.name, loop.pid)
        cap = self.sharing.pool_loaded(slot.name, facts.bytes_per_block, facts.num_kv_blocks,
                                       lambda: loop.snapshot.kv_blocks_used)
        if cap is not None:
            await asyncio.wrap_future(loop.call(partial(set_kv_limit, cap)))
        slot.source_tier = facts.source_tier
        self.cache.bytes_loaded["disk"] += facts.bytes_read
        self._warn_cpu_oversubscription(slot)

    def _warn_cpu_oversubscription(self, slot: ModelSlot) -> None:
        """Workers on a CPU run side by side (the arbiter paces engine threads only), each with torch's
        default of every core unless engine.num_threads is set: two busy workers then fight over the
        cores with spinning OpenMP pools. Said once per load, in the log, with the fix."""
        if not slot.device.startswith("cpu") or slot.config.num_threads:
            return
        others = [s.name for s in self.slots.values() if s is not slot and s.device == slot.device
                  and s.loop is not None and getattr(s.loop, "pid", None) and not s.config.num_threads]
        if others:
            cores = os.cpu_count() or 1
            log.warning("models %s run in engine worker processes on %s, each with all %d cores: busy together "
                        "they oversubscribe the CPU; set engine.num_threads (e.g. %d) or use engine.isolation: "
                        "thread", ", ".join(sorted(others + [slot.name])), slot.device, cores,
                        max(1, cores // (len(others) + 1)))

    def _worker_exited(self, loop, info: dict) -> None:
        """On the event loop: a model's engine worker process exited unasked (its requests got 503s). The model
        is failed with the reason; the next request for it (or a load) starts a fresh worker."""
        slot = self.slots.get(loop.model)
        if slot is None or slot.loop is not loop:
            return  # it was unloaded or replaced meanwhile
        slot.state = "failed"
        slot.error = f"its engine worker process {info['pid']} exited ({info['reason']})"
        slot.worker_exit = info
        slot.loop = None
        slot.loaded.set()
        slot.encoder.shutdown(wait=False)
        self.sharing.detach(slot.name)
        self.cache.device_evicted(slot.name)
        log.error("model %s failed: %s; %d requests failed", slot.name, slot.error, info["num_failed_requests"])
        self.bus.publish({"type": "engine_worker_exit", "t": time.time(), "model": slot.name, "state": "failed",
                          "device": slot.device or None, **info})

    def _load_failed(self, slot: ModelSlot, exc: BaseException) -> None:
        if slot.name in self.sharing.names:
            self.sharing.detach(slot.name)
        slot.state = "failed"
        slot.error = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
        slot.loaded.set()
        self._load_failed_at[slot.name] = time.monotonic()
        self.cache.device_evicted(slot.name)
        log.error("model %s failed to load: %s", slot.name, slot.error, exc_info=not isinstance(exc, UserError))
        self.bus.publish({"type": "model_load", "t": time.time(), "model": slot.name, "phase": "failed",
                          "device": slot.device or None, "error": slot.error})

    async def _make_room(self, name: str, model_dir, cfg) -> str:
        """Pick the device for `name` (M8) and evict least recently used idle models there until it
        fits that device's tier (M7); returns the device."""
        need = await asyncio.to_thread(self._weight_bytes, name)
        busy = {n for n, s in self.slots.items() if n != name and (s.num_in_flight or s.state != "ready")}
        busy |= self._base_set(name)  # a variant runs on its base's weights
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
            self.bus.publish({"type": "model_evict", "t": time.time(), "model": victim, "for": name,
                              "device": plan.device,
                              "to_tier": "host" if self.cache.residency(victim)["host"] else "disk"})
            await self.unload(victim, timeout=0)
        return plan.device

    def _base_set(self, name: str) -> set[str]:
        base = self._base_of(name)
        return {base} if base is not None else set()

    def _device_load(self) -> dict[str, int]:
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
        from gpuservd.routing import DeviceOption, choose_device
        from gpuservd.weights.cache import CacheFull

        plans = self.cache.plan_options(name, need, busy)
        base = self._base_of(name)
        resident = self.cache.device_of(name) or (self.cache.device_of(base) if base else None)
        load = self._device_load()
        options = [DeviceOption(d, i, not isinstance(p, CacheFull), [] if isinstance(p, CacheFull) else p.evict,
                                0 if isinstance(p, CacheFull) else p.evict_bytes, load.get(d, 0),
                                str(p) if isinstance(p, CacheFull) else "")
                   for i, (d, p) in enumerate(plans.items())]
        choice = choose_device(options, resident)
        if choice is None or not choice.feasible:
            full = [p for p in plans.values() if isinstance(p, CacheFull)]
            if resident is not None or len(full) == 1:
                raise plans[resident] if resident is not None else full[0]
            raise CacheFull("; ".join(str(p) for p in full))
        return plans[choice.device]

    def _weight_bytes(self, name: str) -> int:
        """Weight bytes a model will add to the device (from its files' headers; nothing is read):
        a variant's delta, plus its base's weights when they are not there yet (M6)."""
        from gpuservd.runner.model_runner import DTYPES
        from gpuservd.runner.load import SafetensorsReader, expected_bytes
        from gpuservd.store.store import ModelStore

        store, dtype = ModelStore(), DTYPES[self.config.engine.dtype]
        base = self._base_of(name)
        if base is not None:
            from gpuservd.store.layout import read_config
            from gpuservd.store.variant import validate_delta

            spec = validate_delta(store.path(name), read_config(store.path(base)), base)
            own = spec.num_parameters * dtype.itemsize
            return own + (0 if self.cache.has_weights(base) else self._weight_bytes(base))
        return expected_bytes(SafetensorsReader(store.path(name)), dtype)

    def _base_of(self, name: str) -> str | None:
        """A variant's base model (M6); None for a full model."""
        from gpuservd.store.store import ModelStore

        meta = ModelStore().variant_meta(name)
        return str(meta["base"]) if meta else None

    def _variant_dirs(self, name: str, model_dir):
        """(base or None, the directory with the config and tokenizer the model runs with)."""
        from gpuservd.errors import ModelNotFound
        from gpuservd.store.store import ModelStore

        base = self._base_of(name)
        if base is None:
            return None, model_dir
        try:
            return base, ModelStore().path(base)
        except ModelNotFound:
            raise ModelNotFound(f"model {name} is a variant of {base!r}, which is not in the store; "
                                f"pull or import {base} (or remove {name})") from None

    def _weight_source(self, name: str, model_dir):
        """(weight source, tier name) for a load. A variant (M6): its delta over the base's weights
        in memory ("delta"), the base loaded first when absent ("delta+<base's tier>"). A full model:
        its weights held for its variants ("device"), else the host copy, else the store (its INT8
        file under compression: int8, written on first use); built weights are registered with the
        cache, which shares them with the variants that come later."""
        from gpuservd.weights.delta import SharedSource

        base = self._base_of(name)
        if base is not None:
            return self._variant_source(name, base, model_dir)

        def share(build):
            return self.cache.shared_weights(name, build)

        if self.cache.has_weights(name):
            return SharedSource(model_dir, share), "device"
        source, tier = self._tier_source(name, model_dir)
        return SharedSource(source, share), tier

    def _variant_source(self, name: str, base: str, model_dir):
        from gpuservd.runner.load import load_weights
        from gpuservd.store.layout import read_config
        from gpuservd.store.store import ModelStore
        from gpuservd.weights.delta import VariantSource

        base_dir = ModelStore().path(base)
        tier = ["delta"]
        if not self.cache.has_weights(base):
            tier[0] = "delta+" + ("host" if self.cache.residency(base)["host"] else "disk")

        def base_weights(arch, dtype, device):
            def build():  # the base as a hidden dependency: its weights, without an engine of its own
                source, base_tier = self._tier_source(base, base_dir)
                log.info("model %s: loading its base %s from the %s tier", name, base, base_tier)
                return load_weights(source, arch, dtype, device)

            weights = self.cache.shared_weights(base, build)
            self.cache.hold_base(base, weights.nbytes(), name)
            return weights

        return VariantSource(base_weights, model_dir, read_config(base_dir), base), tier[0]

    def _tier_source(self, name: str, model_dir):
        """(tensor source, tier name): the host copy, else the store (INT8 under compression: int8)."""
        copy_ = self.cache.host_copy(name)
        if copy_ is not None:
            self.cache.bytes_loaded["host"] += copy_.nbytes
            return copy_, "host"
        from gpuservd.worker.build import store_source

        source, tier, nbytes = store_source(model_dir, self.config.cache.compression)
        self.cache.bytes_loaded["disk"] += nbytes
        return source, tier

    def _keep_host_copy(self, name: str, model_dir) -> None:
        from gpuservd.runner.load import SafetensorsReader

        try:
            self.cache.keep_host_copy(name, SafetensorsReader(model_dir))
        except Exception as exc:  # the host tier is an optimisation: the disk still serves
            log.warning("model %s: no host copy kept (%s)", name, exc)

    def _slot(self, name: str) -> ModelSlot:
        slot = self.slots.get(name)
        if slot is None:
            raise APIError(404, f"model {name} is not loaded; loaded: {', '.join(self.model_names(False)) or 'none'}",
                           "invalid_request_error", "model", "model_not_found")
        return slot

    async def unload(self, name: str, timeout: float | None = None, force: bool = False) -> dict:
        """Stop admitting for the model, let its requests finish (up to timeout), abort the rest, free it."""
        slot = self._slot(name)
        if slot.pinned and not force:
            raise APIError(409, f"model {name} is pinned; unpin it first (gpuserv models pin {name} --off)",
                           "invalid_request_error", "model", "model_pinned")
        if slot.state == "loading":
            await slot.loaded.wait()
        slot.state = "unloading"
        timeout = self.config.server.drain_timeout if timeout is None else timeout
        finished, aborted = await self._wait_then_abort([a for a in self.active.values() if a.slot is slot], timeout)
        if slot.loop is not None:
            await asyncio.to_thread(slot.loop.stop)
        slot.encoder.shutdown(wait=False)
        self.slots.pop(name, None)
        self.sharing.detach(name)
        self.cache.device_evicted(name)
        self.bus.publish({"type": "model_unload", "t": time.time(), "model": name, "device": slot.device or None,
                          "num_aborted": aborted})
        log.info("model %s unloaded (%d requests finished, %d aborted)", name, finished, aborted)
        return {"model": name, "num_finished": finished, "num_aborted": aborted}

    def pin(self, name: str, pinned: bool) -> dict:
        slot = self._slot(name)
        slot.pinned = pinned
        self.cache.set_pinned(name, pinned)
        self.bus.publish({"type": "model_pin", "t": time.time(), "model": name, "pinned": pinned})
        return {"model": name, "pinned": pinned}

    def set_versions(self, alias: str, weights: dict | None) -> dict:
        """Change an alias's version weights at run time (admin API, reload)."""
        try:
            return self.router.set(alias, weights)
        except UserError as exc:
            raise protocol.bad_request(str(exc), "weights") from None

    # ---- requests, drain --------------------------------------------------------------------------
    def cancel(self, request_id: str) -> bool:
        active = self.active.get(request_id)
        if active is None or active.done:
            # done: its last output (perhaps from an earlier cancel) has been handed out and the
            # stream is ending; the entry only lingers until the handler's cleanup runs.
            return False
        active.abort()
        return True

    async def _wait_then_abort(self, actives: list[ActiveRequest], timeout: float) -> tuple[int, int]:
        """Wait up to timeout for these requests to end; abort the rest. Returns (finished, aborted)."""
        ids = {a.ctx.request_id for a in actives}
        deadline = time.monotonic() + timeout
        while any(i in self.active for i in ids) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = [self.active[i] for i in ids if i in self.active]
        for a in left:
            a.abort()
        end = time.monotonic() + 10.0
        while any(i in self.active for i in ids) and time.monotonic() < end:
            await asyncio.sleep(0.02)
        return len(ids) - len(left), len(left)

    async def drain(self, timeout: float | None = None) -> dict:
        """Stop admitting (503), let in-flight requests finish up to timeout, abort the rest (idempotent)."""
        if self._drain_task is None:
            self.state = "draining"
            timeout = self.config.server.drain_timeout if timeout is None else timeout
            log.info("draining: %d requests in flight, waiting up to %.0f s", len(self.active), timeout)
            self.bus.publish({"type": "drain", "t": time.time(), "phase": "start", "num_in_flight": len(self.active),
                              "timeout_s": timeout})
            self._drain_task = asyncio.ensure_future(self._wait_then_abort(list(self.active.values()), timeout))
        finished, aborted = await asyncio.shield(self._drain_task)
        self.bus.publish({"type": "drain", "t": time.time(), "phase": "done", "num_finished": finished,
                          "num_aborted": aborted})
        return {"num_finished": finished, "num_aborted": aborted}

    def abort_all(self) -> None:
        for a in list(self.active.values()):
            a.abort()

    def resume(self) -> None:
        """Admit again after a drain that did not exit."""
        self._drain_task = None
        self.state = "serving"

    async def stop_engines(self) -> None:
        for slot in list(self.slots.values()):
            if slot.loop is not None:
                await asyncio.to_thread(slot.loop.stop)
            slot.encoder.shutdown(wait=False)
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
            preemption=snap.preemption if snap else None, tiers=self.cache.residency(slot.name),
            weights_bytes=slot.weights_bytes, num_layers=slot.num_layers, layers_ready=slot.layers_ready,
            source_tier=slot.source_tier, **self.sharing.model_fields(slot.name))

    def status(self) -> dict:
        st = DaemonStatus(
            version=__version__, pid=os.getpid(), uptime_s=round(time.monotonic() - self.started, 3),
            state=self.state, device=self.device, socket=self.socket, tcp=self.tcp,
            models=[self.model_status(s) for _, s in sorted(self.slots.items())], num_in_flight=len(self.active),
            num_requests_total=self.num_requests_total, num_rejected_total=self.num_rejected_total)
        data = asdict(st)
        data["device"] = {**self.device, "readings": self.sharing.readings}
        sharing = self.sharing.status()
        data["sharing"] = sharing["backend"]  # the partition backend and its one-line summary
        data["partitions"], data["quotas"], data["arbiter"] = sharing["partitions"], sharing["quotas"], sharing["arbiter"]
        data["versions"] = self.router.status()
        data["weight_cache"] = self.cache.status()
        load = self._device_load()  # M8: per device its tier (budget, bytes, models) and its load
        tiers = data["weight_cache"].pop("devices")
        data["devices"] = {d: {**tier, "load": load.get(d, 0)} for d, tier in tiers.items()}
        data["weight_cache"]["prefetch"] = {"enabled": self.config.cache.prefetch, **self.prefetch_stats.to_dict()}
        data["tenants"] = {name: {"queued": self.tenant_queued.get(name, 0),
                                  "in_flight": self.tenant_in_flight.get(name, 0)} for name in self.tenants.names()}
        srv = self.config.server
        data["limits"] = {"max_queued_per_model": srv.max_queued_per_model,
                          "max_queued_per_tenant": srv.max_queued_per_tenant, "drain_timeout": srv.drain_timeout}
        data["events"] = {"subscribers": self.bus.num_subscribers, "published": self.bus.num_published,
                          "dropped": self.bus.num_dropped}
        data["hints"] = self.hints.hints()  # active troubleshooting hints, with their evidence
        data["hint_rules"] = self.hints.rule_status()  # per rule: fed by this daemon, or what it lacks
        return data

    async def requests(self) -> list[dict]:
        """The unfinished requests, with the engine's view of each (state, tokens, preemptions)."""
        from gpuservd.engine_calls import request_views

        views: dict[str, dict] = {}
        for slot in list(self.slots.values()):
            if slot.loop is None or not slot.loop.alive:
                continue
            try:
                views.update(await asyncio.wrap_future(slot.loop.call(request_views)))
            except RuntimeError:  # its worker process exited meanwhile: its requests are failing
                continue
        now = time.monotonic()
        out = []
        for rid, a in self.active.items():
            row = {"request_id": rid, "model": a.slot.name, "tenant": a.ctx.tenant.name, "uid": a.ctx.uid,
                   "age_s": round(now - a.ctx.arrival, 3), "num_prompt_tokens": a.num_prompt_tokens,
                   "state": "tokenizing", "num_output_tokens": a.num_output_tokens, "num_preemptions": 0}
            row.update(views.get(rid, {}))
            out.append(row)
        return out

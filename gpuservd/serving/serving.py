"""What the HTTP layer serves: admission control, request streams, drain (over the hosted models).

Runs on the event loop; the models themselves (slots, loads, eviction, device
routing, workers) are `gpuservd/serving/models.py`'s. Admission (tenants' priorities and quotas, versions) is
decided here before a request reaches an engine: draining, an unknown model, a
model not ready, a full per-model or per-tenant queue. Each refusal is a domain
error (gpuservd/errors.py) that the API layer turns into its HTTP response. A
request counts as *queued* from admission until its first token, and as *in
flight* until its last.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict

from gpuservd import __version__
from gpuservd.serving.daemon_config import DaemonConfig
from gpuservd.engine.request import GuidedSpec, SamplingParams
from gpuservd.engine.tokenizer import encode_chat, encode_raw
from gpuservd.engine.loop import Accepted, EngineGone, Failed, Submission
from gpuservd.errors import (Draining, EngineFailed, InvalidRequest, ModelNotServed, ModelUnavailable,
                             PromptTooLong, QueueFull, ServingError, UserError)
from gpuservd.events import EventBus
from gpuservd.events.types import Drain, RequestFinished, RequestPrompt
from gpuservd.hints.monitor import HintMonitor
from gpuservd.serving.cpu_time import cpu_reading
from gpuservd.serving.models import Models
from gpuservd.serving.request_stream import ActiveRequest, ModelSlot, RequestContext, engine_gone
from gpuservd.serving.tenants import TenantMap
from gpuservd.wire.generation import GenerationRequest
from gpuservd.wire.status import DaemonStatus, ModelStatus

log = logging.getLogger("gpuservd.serving")
access_log = logging.getLogger("gpuservd.access")


class Serving:
    """Admission and request streams over the hosted models; the HTTP routes call into this."""

    def __init__(self, config: DaemonConfig, tenants: TenantMap, metrics=None, bus: EventBus | None = None,
                 device: dict | None = None):
        self.config = config
        self.tenants = tenants
        self.metrics = metrics  # api.metrics.Metrics (None in some tests)
        self.bus = bus or EventBus(config.server.event_queue_size)
        self.device = device or {"backend": "cpu"}
        self.models = Models(config, tenants.quotas(), metrics, self.bus, self.device, self._end_requests)
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
        self.hints = HintMonitor()  # sees every event; the daemon runs its once-a-second evaluation
        self.bus.taps.append(self.hints.observe)

    # ---- the hosted models (models.py), as the routes and the daemon reach them --------------------
    @property
    def slots(self) -> dict[str, ModelSlot]:
        return self.models.slots

    @property
    def cache(self):
        return self.models.cache

    @property
    def sharing(self):
        return self.models.sharing

    @property
    def devices(self) -> list[str]:
        return self.models.devices

    def model_names(self, ready_only: bool = True) -> list[str]:
        return self.models.model_names(ready_only)

    async def load(self, name: str, pinned: bool = False) -> ModelSlot:
        return await self.models.load(name, pinned)

    async def unload(self, name: str, timeout: float | None = None, force: bool = False) -> dict:
        return await self.models.unload(name, timeout, force)

    def pin(self, name: str, pinned: bool) -> dict:
        return self.models.pin(name, pinned)

    def set_versions(self, alias: str, weights: dict | None) -> dict:
        return self.models.set_versions(alias, weights)

    def model_status(self, slot: ModelSlot) -> ModelStatus:
        return self.models.model_status(slot)

    async def stop_engines(self) -> None:
        await self.models.stop_engines()

    # ---- admission --------------------------------------------------------------------------------
    def set_tenants(self, tenants: TenantMap) -> None:
        """New tenants (reload): identity and queue limits at once, engine quotas between steps."""
        self.tenants = tenants
        self.models.set_tenant_quotas(tenants.quotas())

    def reject(self, reason: str) -> None:
        self.num_rejected_total += 1
        if self.metrics is not None:
            self.metrics.rejected(reason)

    def _admit(self, greq: GenerationRequest, ctx: RequestContext) -> ModelSlot:
        if self.state == "draining":
            self.reject("draining")
            raise Draining("the daemon is draining and admits no new requests")
        slot = self.slots.get(greq.model)
        if slot is None or slot.state == "failed":
            self.reject("model_not_found")
            failed = "failed" if slot and slot.worker_exit else "failed to load"
            hint = f" ({greq.model} {failed}: {slot.error})" if slot else ""
            names = ", ".join(self.model_names()) or "none"
            raise ModelNotServed(f"The model `{greq.model}` does not exist or is not loaded; loaded models: "
                                 f"{names}.{hint}", "model")
        if slot.state != "ready":
            self.reject(slot.state)
            raise ModelUnavailable(f"model {greq.model} is {slot.state}; retry shortly", code=f"model_{slot.state}",
                                   retry_after_s=5)
        limit = self.config.server.max_queued_per_model
        if slot.num_queued >= limit:
            self.reject("queue_full")
            raise QueueFull(f"model {greq.model} has {slot.num_queued} requests waiting (limit {limit}); "
                            "retry later", retry_after_s=slot.retry_after_s())
        t = ctx.tenant
        tlimit = t.max_queued or self.config.server.max_queued_per_tenant
        if self.tenant_queued.get(t.name, 0) >= tlimit:
            self.reject("tenant_queue_full")
            raise QueueFull(f"tenant {t.name} has {self.tenant_queued[t.name]} requests waiting "
                            f"(limit {tlimit}); retry later", retry_after_s=slot.retry_after_s())
        if t.max_in_flight and self.tenant_in_flight.get(t.name, 0) >= t.max_in_flight:
            self.reject("tenant_in_flight")
            raise QueueFull(f"tenant {t.name} has {t.max_in_flight} unfinished requests (its limit); "
                            "retry later", retry_after_s=slot.retry_after_s())
        return slot

    def _encode(self, slot: ModelSlot, greq: GenerationRequest) -> list[int]:
        """Token ids of the prompt (runs on the model's encoder thread)."""
        if greq.kind == "chat":
            tools = greq.tools if greq.tool_choice != "none" else None
            return encode_chat(slot.tokenizer, greq.messages, tools, greq.chat_template_kwargs)
        if greq.prompt_token_ids is not None:
            return greq.prompt_token_ids
        return encode_raw(slot.tokenizer, greq.prompt)

    def _sampling(self, greq: GenerationRequest, num_prompt_tokens: int, slot: ModelSlot) -> SamplingParams:
        max_tokens = greq.max_tokens
        if max_tokens is None:  # chat without a limit: the rest of the context, as vLLM does
            max_tokens = slot.max_model_len - num_prompt_tokens
            if max_tokens < 1:
                raise InvalidRequest(f"the messages take {num_prompt_tokens} tokens and fill the context "
                                     f"length {slot.max_model_len}; shorten them", "messages")
        guided = GuidedSpec(**greq.guided) if greq.guided else None
        return SamplingParams(max_tokens=max_tokens, guided=guided, **greq.sampling_kwargs())

    # ---- requests ---------------------------------------------------------------------------------
    async def start(self, greq: GenerationRequest, ctx: RequestContext) -> ActiveRequest:
        """Admit, tokenize and queue a request; returns once the engine accepted it (else raises a
        ServingError)."""
        greq.model = self.models.router.pick(greq.model)  # a versioned name: the version that serves it
        await self.models.ensure_loaded(greq.model, draining=self.state == "draining")
        slot = self._admit(greq, ctx)
        if greq.keep_alive is not None:  # Ollama's: the last request's keep_alive holds for its model
            slot.keep_alive_s = greq.keep_alive
        slot.last_active = time.monotonic()
        active = ActiveRequest(slot, ctx, greq, self._dequeued, self._release)
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
            ids = await self._prompt_ids(slot, greq)
            active.num_prompt_tokens = len(ids)
            active.prompt_token_ids = ids
            # `gpuserv record --with-prompts` is listening (an admin: /admin/events is admin-only)
            if self.config.server.log_prompts and self.bus.wants(RequestPrompt.type):
                self._publish_prompt(slot, greq, ctx, ids)
            params = self._sampling(greq, len(ids), slot)
            priority = ctx.tenant.effective_priority(greq.priority)
            if slot.loop is None or slot.state != "ready":
                raise ModelUnavailable(f"model {greq.model} is {slot.state}; retry shortly", code="model_unavailable",
                                       retry_after_s=5)
            slot.loop.submit(Submission(ctx.request_id, ids, params, active.sink, priority, tname, ctx.arrival))
            submitted = True
            first = await active.sink.get()
            self._check_accepted(first, greq, ctx)
            if not isinstance(first, Accepted):  # an abort raced the acceptance (drain): hand the output back
                active.sink.unget(first)
            return active
        except BaseException as exc:
            refused = isinstance(exc, ServingError)
            if submitted and not refused and slot.loop is not None:
                slot.loop.abort(ctx.request_id)  # cancelled while queued: drop it from the engine
            active.done = True
            active.status = exc.status if refused else 500
            if refused:
                self.reject("bad_request" if exc.status == 400 else f"http_{exc.status}")
            active.close()
            raise

    async def _prompt_ids(self, slot: ModelSlot, greq: GenerationRequest) -> list[int]:
        if greq.prompt_token_ids is not None:
            return greq.prompt_token_ids
        try:
            return await asyncio.get_running_loop().run_in_executor(slot.encoder, self._encode, slot, greq)
        except UserError as exc:
            raise InvalidRequest(str(exc), "messages" if greq.kind == "chat" else "prompt") from None

    @staticmethod
    def _check_accepted(first, greq: GenerationRequest, ctx: RequestContext) -> None:
        """The engine's first answer to a submission: raise when it refused the request or is gone."""
        if isinstance(first, EngineGone):
            raise engine_gone(first)
        if isinstance(first, Failed):
            if first.internal:
                raise EngineFailed(ctx.request_id)
            msg = str(first.error)
            param = getattr(first.error, "param", None) or (
                "max_tokens" if "max_tokens" in msg else ("prompt" if greq.kind == "completion" else "messages"))
            raise PromptTooLong(msg, param) if "context" in msg else InvalidRequest(msg, param)

    def _dequeued(self, active: ActiveRequest) -> None:
        self.tenant_queued[active.ctx.tenant.name] -= 1

    def _release(self, active: ActiveRequest) -> None:
        slot, ctx = active.slot, active.ctx
        slot.num_in_flight -= 1
        self.tenant_in_flight[ctx.tenant.name] -= 1
        self.active.pop(ctx.request_id, None)
        if not self.active:
            self._idle.set()
        now = time.monotonic()
        slot.last_active = now
        if active.status == 200:
            slot.finish_times.append(now)
        ttft = (active.first_token_at - ctx.arrival) if active.first_token_at else None
        self.bus.publish(RequestFinished(
            model=slot.name, request_id=ctx.request_id, tenant=ctx.tenant.name, uid=ctx.uid, status=active.status,
            finish_reason=active.finish_reason, num_prompt_tokens=active.num_prompt_tokens,
            num_output_tokens=active.num_output_tokens, ttft_s=ttft, e2e_s=now - ctx.arrival,
            priority=ctx.tenant.effective_priority(active.greq.priority), arrival_t=time.time() - (now - ctx.arrival)))
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
        self.bus.publish(RequestPrompt(model=slot.name, request_id=ctx.request_id, prompt=text))

    def cancel(self, request_id: str) -> bool:
        """Abort a request, every choice of it when it has n > 1 (False: none of them is running)."""
        choices = [a for rid, a in self.active.items() if rid == request_id or a.ctx.group_id == request_id]
        # done: its last output (perhaps from an earlier cancel) has been handed out and the
        # stream is ending; the entry only lingers until the handler's cleanup runs.
        running = [a for a in choices if not a.done]
        for a in running:
            a.abort()
        return bool(running)

    # ---- drain ------------------------------------------------------------------------------------
    async def _end_requests(self, slot: ModelSlot, timeout: float) -> tuple[int, int]:
        """The model manager's hook before an unload: end this slot's requests (finish, else abort)."""
        return await self._wait_then_abort([a for a in self.active.values() if a.slot is slot], timeout)

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
        # Counted by how each one ended, not by whom this wait aborted: a second SIGTERM (abort_all)
        # may have aborted them all while this wait still ran.
        aborted = sum(a.finish_reason == "abort" for a in actives)
        return len(actives) - aborted, aborted

    async def drain(self, timeout: float | None = None) -> dict:
        """Stop admitting (503), let in-flight requests finish up to timeout, abort the rest (idempotent)."""
        if self._drain_task is None:
            self.state = "draining"
            timeout = self.config.server.drain_timeout if timeout is None else timeout
            log.info("draining: %d requests in flight, waiting up to %.0f s", len(self.active), timeout)
            self.bus.publish(Drain(phase="start", num_in_flight=len(self.active), timeout_s=timeout))
            self._drain_task = asyncio.ensure_future(self._wait_then_abort(list(self.active.values()), timeout))
        finished, aborted = await asyncio.shield(self._drain_task)
        self.bus.publish(Drain(phase="done", num_finished=finished, num_aborted=aborted))
        return {"num_finished": finished, "num_aborted": aborted}

    def abort_all(self) -> None:
        for a in list(self.active.values()):
            a.abort()

    def resume(self) -> None:
        """Admit again after a drain that did not exit."""
        self._drain_task = None
        self.state = "serving"

    # ---- status -----------------------------------------------------------------------------------
    def status(self) -> dict:
        st = DaemonStatus(
            version=__version__, pid=os.getpid(), uptime_s=round(time.monotonic() - self.started, 3),
            state=self.state, device=self.device, socket=self.socket, tcp=self.tcp,
            models=[self.model_status(s) for _, s in sorted(self.slots.items())], num_in_flight=len(self.active),
            num_requests_total=self.num_requests_total, num_rejected_total=self.num_rejected_total,
            process=cpu_reading([s.loop.pid for s in self.slots.values() if s.loop is not None and s.loop.pid]))
        data = asdict(st)
        data.update(self.models.status_sections())
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
        views = await self.models.engine_views()
        now = time.monotonic()
        out = []
        for rid, a in self.active.items():
            row = {"request_id": rid, "model": a.slot.name, "tenant": a.ctx.tenant.name, "uid": a.ctx.uid,
                   "age_s": round(now - a.ctx.arrival, 3), "num_prompt_tokens": a.num_prompt_tokens,
                   "state": "tokenizing", "num_output_tokens": a.num_output_tokens, "num_preemptions": 0,
                   "sampling": a.greq.summary()}
            row.update(views.get(rid, {}))
            out.append(row)
        return out

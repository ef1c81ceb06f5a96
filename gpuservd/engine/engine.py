"""The engine: step() = schedule -> execute -> update, for one model on one device.

It does no I/O and never sleeps; the CLI, the bench and the daemon drive it by calling step() in a loop.
Everything a step decided is in the SchedulerOutput, and everything it cost is one StepRecord in the telemetry ring."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from gpuservd.background import in_background
from gpuservd.config import EngineConfig
from gpuservd.engine import detokenizer, offline, overlap, preemption, prompt_logprobs, step_rows
from gpuservd.engine.grammar import Grammars
from gpuservd.engine.preemption import Granularity
from gpuservd.engine.quota import TenantQuota
from gpuservd.engine.request import FinishReason, Request, RequestOutput, RequestState, SamplingParams
from gpuservd.engine.row_failures import RowFailures
from gpuservd.engine.sampler import SamplerOutput, TokenLogprobs
from gpuservd.engine.schedule_output import KVLayout, SchedulerOutput
from gpuservd.engine.scheduler import Scheduler
from gpuservd.engine.telemetry import StepRecord, Telemetry
from gpuservd.engine.tokenizer import load_tokenizer
from gpuservd.errors import UserError
from gpuservd.events.types import Event, LayerResume, LayerSuspend, Victim
from gpuservd.kv_cache.swap import HostKVPool, Swapper, host_bandwidth
from gpuservd.runner.decode_step import DecodeResult
from gpuservd.runner.llama import LayerCheckpoint
from gpuservd.runner.model_runner import ModelRunner
from gpuservd.runner.omp import use_threads
from gpuservd.store.store import ModelStore


class LLMEngine:
    """Continuous-batching engine for one model."""

    def __init__(self, model_name: str, model_dir: Path, config: EngineConfig, tokenizer=None,
                 weight_source=None, initial_layers: int | None = None, on_layer=None):
        config.validate()
        # The OpenMP team this thread steps with (runner/omp.py); None leaves the thread's count as it is.
        self.num_threads = use_threads(config.num_threads) if config.num_threads else None
        self.name = model_name
        self.config = config
        pending_tokenizer = None
        if tokenizer is None:  # read beside the weights: a cold load waits on the disk, not on the CPU

            pending_tokenizer = in_background("tokenizer-load", load_tokenizer, model_dir)
        self.runner = ModelRunner(
            model_dir,
            dtype=config.dtype,
            device=config.device,
            block_size=config.block_size,
            kv_cache_bytes=config.kv_cache_bytes,
            device_memory_bytes=config.device_memory_bytes,
            kv_cache_fraction=config.kv_cache_fraction,
            max_model_len=config.max_model_len,
            weight_source=weight_source,
            initial_layers=initial_layers,
            on_layer=on_layer,
            cuda_graphs_config=config.cuda_graphs,
        )
        if pending_tokenizer is not None:
            tokenizer = pending_tokenizer.result()
        self.tokenizer = tokenizer
        eos = set(self.runner.arch.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        cache = self.runner.cache
        self.grammars = Grammars(tokenizer, self.runner.arch.vocab_size, self.eos_token_ids,
                                 overlap=cache.kv.is_cuda)
        self.pool = cache.pool
        self.host_pool = HostKVPool(cache.shape, config.preemption.swap_space_bytes, pin=cache.kv.is_cuda)
        self.swapper = Swapper(cache, self.host_pool)
        layout = KVLayout(cache.shape.num_layers, cache.shape.bytes_per_block)
        # The prefix cache's hashes are seeded with what the KV depends on: the weights (a variant's
        # name differs from its base's) and the dtype they compute in.
        namespace = f"{model_name}\0{model_dir}\0{config.dtype}"
        self.scheduler = Scheduler(config.scheduler, self.pool, config.block_size, config.preemption,
                                   host_pool=self.host_pool, layout=layout, prefix_caching=config.prefix_caching,
                                   namespace=namespace)
        # The planner prices swaps with this link's measured bandwidth from the start. On CUDA the pinned
        # pool is still being allocated beside the load: there the first swap (assumed the cheaper kind
        # until measured) measures the link instead, through its CUDA events.
        if not cache.kv.is_cuda:
            self.scheduler.cost.host_bandwidth = host_bandwidth(self.swapper, config.dtype)
        self._events: list[Event] = []  # the engine's own events (suspends, auto-mode switches) for the next StepRecord
        # Layer granularity: interrupt(priority) -> True when a request more urgent than that priority
        # is waiting to be added (the daemon's loop and the bench set it; it must be cheap).
        self.interrupt = None
        self._yield_point = None
        # () -> True while no model shares the device (the arbiter handle's): a step then calls no yield
        # point and a CPU forward may run its layers in one op. None: a set yield point always runs.
        self.device_alone = None
        self._suspended: _Suspended | None = None
        self._carried: list[RequestOutput] = []  # outputs of a suspended forward finished by an abort
        self.rows = RowFailures()  # the sampler, failing a request alone when its row raises (rows.take())
        self.telemetry = Telemetry(config.telemetry_ring_size)
        self.requests: dict[str, Request] = {}
        # Decode steps launched before the last one is read (engine/overlap.py): on for CUDA by default.
        self.overlap = config.overlap if config.overlap is not None else self.runner.device.type == "cuda"
        self._inflight: overlap.InFlight | None = None

    @property
    def yield_point(self):
        """yield_point(layer), called after each layer and halfway through it, may block while another
        model runs (the sharing arbiter's time slices); None when this engine has the device to itself."""
        return self._yield_point

    @yield_point.setter
    def yield_point(self, fn) -> None:
        self._yield_point = fn
        self.runner.model.mid_layer = fn
        if fn is not None:  # CUDA graphs: per-layer segments, so the yields run between their replays
            self.runner.prepare_yields()

    @classmethod
    def from_store(cls, model_name: str, config: EngineConfig | None = None, store=None) -> "LLMEngine":
        config = config or EngineConfig(model=model_name)
        store = store or ModelStore()
        info = store.check(model_name)  # names the exact missing or damaged file before any load
        return cls(model_name, info.path, config)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    # -- requests ---------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        tenant: str = "default",
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request; raises UserError for anything that could never be served."""
        params.validate()
        if request_id in self.requests:
            raise UserError(f"request id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        if n < 1:
            raise UserError("the prompt is empty")
        vocab = self.runner.arch.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise UserError(f"prompt token ids must be in [0, {vocab})")
        if n + params.max_tokens > self.max_model_len:
            raise UserError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                f"exceeds the context length {self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        need = -(-(n + params.max_tokens) // self.config.block_size)
        if need > self.pool.num_blocks:
            raise UserError(
                f"the request needs {need} KV blocks but the pool has {self.pool.num_blocks}; "
                "lower max_tokens or raise engine.kv_cache_bytes"
            )
        if need > self.pool.capacity:
            raise UserError(self._quota_message(need))
        cap = self.scheduler.quota(tenant).max_kv_blocks
        if cap and need > cap:
            raise UserError(
                f"the request needs {need} KV blocks but tenant {tenant!r} may hold {cap}; lower max_tokens"
            )
        params.check_vocab(vocab)
        req = Request(request_id, list(prompt_token_ids), params, priority=priority, tenant=tenant)
        # Unseeded requests still draw from a seed of their own, so their draws never depend on the batch.
        req.sample_seed = params.seed if params.seed is not None else random.getrandbits(63)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        if params.detokenize:
            detokenizer.start(req)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first token: nothing predicts it
        # A grammar that does not compile: FieldError, nothing held yet. One that waits for llguidance's
        # tokenizer (the first constrained request) joins the scheduler when it is built (Grammars.admit).
        waits = params.guided is not None and not self.grammars.start(req)
        self.requests[request_id] = req
        if not waits:
            self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its KV blocks are free when this returns. Returns its final output
        (finish reason `abort`), or None when the id is unknown or already finished."""
        if request_id not in self.requests:
            return None
        if self._suspended is not None and self.requests[request_id] in self._suspended.requests:
            # Its KV is half written by a suspended forward: finish that forward first, so no
            # freed block is written afterwards; the others' tokens go out with the next step.
            self._carried += self._finish_suspended()
            if request_id not in self.requests:
                return None  # it finished in that forward
        req = self.requests.pop(request_id)
        overlap.unpend(req)
        self.scheduler.remove(req)
        return self._finish(req, RequestState.FINISHED_ABORTED, FinishReason.ABORT)

    def _quota_message(self, need: int) -> str:
        return (f"the request needs {need} KV blocks but model {self.name}'s memory quota allows "
                f"{self.pool.capacity} (of its {self.pool.num_blocks}); lower max_tokens or raise "
                f"sharing.models.{self.name}.memory_quota_bytes")

    def unservable(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests that can no longer fit the KV pool's capacity: a memory quota
        lowered below what they need. Without a quota below the pool's size this is always empty."""
        cap = self.pool.capacity
        if cap >= self.pool.num_blocks:
            return []
        out = []
        for rid, r in self.requests.items():
            need = -(-(r.num_prompt_tokens + r.params.max_tokens) // self.config.block_size)
            if need > cap:
                out.append((rid, self._quota_message(need)))
        return out

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._carried) or bool(self.grammars.pending)
                or self._inflight is not None)

    def preemption_status(self) -> dict:
        """The preemption settings in force and the state of the host pool (for /admin/status)."""
        return preemption.status(self.scheduler, self.config.preemption, self.host_pool,
                                 len(self._suspended.requests) if self._suspended else 0)

    def decode_status(self) -> dict:
        """How decode steps run (CUDA graphs, the fixed-shape step eagerly, or the eager batch) and why, whether
        they overlap, and the OpenMP team the calling (engine) thread steps with."""
        on = self.overlap and self.runner.decode_step is not None  # overlap chains fixed-shape steps only
        return {**self.runner.decode_status(), "overlap": on, "threads": torch.get_num_threads()}

    def prefix_cache_status(self) -> dict:
        """Prefix caching: on or off, what it found (tokens, as vLLM counts them) and what it holds."""
        kv = self.scheduler.kv
        st = kv.prefix.stats
        return {"enabled": kv.prefix.enabled, "query_tokens": st.num_query_tokens, "hit_tokens": st.num_hit_tokens,
                "hit_rate": round(st.num_hit_tokens / st.num_query_tokens, 4) if st.num_query_tokens else 0.0,
                "repeat_tokens": st.num_repeat_tokens, "cached_blocks": self.pool.num_cached,
                "evicted_blocks": self.pool.num_evicted, "resets": st.num_resets}

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache (requests keep the blocks they hold); returns the blocks forgotten."""
        return self.scheduler.kv.reset_prefix_cache()

    def set_tenant_quotas(self, quotas: dict[str, TenantQuota]) -> None:
        """Per-tenant limits (weight, running sequences, KV blocks); replaces the previous set."""
        self.scheduler.quotas = dict(quotas)

    # -- the step ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule, move KV, forward, sample. With granularity `layer`, a forward carrying prefill may
        stop between layers when `interrupt(priority)` says a more urgent request waits; the next step serves it
        without the suspended batch, and the one after finishes the suspended forward where it stopped."""
        if self.num_threads and torch.get_num_threads() != self.num_threads:
            use_threads(self.num_threads)  # a library's first parallel op on this thread reset it (runner/omp.py)
        carried, self._carried = self._carried, []
        if self.grammars.pending:  # a request whose grammar failed to attach ends as a failed row
            idle = not self.scheduler.has_unfinished() and not carried
            for req, exc in self.grammars.admit(self.scheduler, idle):
                self.rows.fail(req.request_id, exc)
                carried += [o for o in [self.abort(req.request_id)] if o is not None]
        if self._suspended is not None and self._suspended.served:
            return carried + self._finish_suspended()
        t0 = time.perf_counter()
        inflight = self._suspended.requests if self._suspended is not None else []
        for r in inflight:  # in the middle of a forward: not schedulable, not a victim
            self.scheduler.running.remove(r)
        try:
            sched = self.scheduler.schedule()
        finally:
            self.scheduler.running[:0] = inflight
        if self._suspended is not None:
            self._suspended.served = True
        flight, self._inflight = self._inflight, None
        if self.overlap and overlap.chainable(self, sched):
            return carried + overlap.launch(self, sched, flight, t0)
        if flight is not None:  # the step in flight is read before this one runs
            carried += overlap.land(self, flight)
            overlap.drop_finished(self, sched)
        forward_s = 0.0
        outputs: list[RequestOutput] = []
        ts = time.perf_counter()
        self.swapper.execute(sched.moves)  # CUDA: enqueued; swap-outs' host copies run beside the forward
        swap_s = time.perf_counter() - ts
        if not sched.empty:
            chunks = step_rows.seq_chunks(sched.chunks, self.scheduler.kv, self.eos_token_ids,
                                          on_device=self.runner.decode_step is not None)
            masks = self.grammars.fill_async([c.request for c in sched.chunks if c.sample])
            t1 = time.perf_counter()
            try:
                result = self.runner.execute(chunks, suspend=self._layer_hook(sched))
            finally:
                filled = masks.result() if masks is not None else None  # no matcher may advance before
            forward_s = time.perf_counter() - t1
            if isinstance(result, LayerCheckpoint):
                self._suspended = _Suspended(sched, result, [c.request for c in sched.chunks], forward_s)
                self._events.append(LayerSuspend(layer=result.next_layer,
                                                  request_ids=[c.request.request_id for c in sched.chunks]))
            else:
                if sched.num_prefill_tokens >= 4 * sched.num_decode_tokens:
                    self.scheduler.cost.observe_prefill(sched.num_prefill_tokens, forward_s)
                outputs = self._update(sched, result, filled)
        self.swapper.finish()  # CUDA: the copies' seconds (their own time on the streams)
        for m in sched.moves:
            self.scheduler.cost.observe_copy(m.bytes_moved, m.bytes_parked, m.seconds)
        self._record(sched, t0, forward_s, swap_s, outputs)
        return carried + outputs

    def _layer_hook(self, sched: SchedulerOutput | None):
        """What the forward calls after each layer: the arbiter's yield point, then the suspend check."""
        check = self._suspend_check(sched) if sched is not None else None
        yield_point = None if self.device_alone is not None and self.device_alone() else self._yield_point
        self.runner.model.mid_layer = yield_point  # the halfway point of each layer, for this forward
        if yield_point is None:
            return check

        def hook(layer: int) -> bool:
            yield_point(layer)
            return check(layer) if check is not None else False

        return hook

    def _suspend_check(self, sched: SchedulerOutput):
        """The per-layer predicate for this step's forward, or None when it may not be suspended."""
        if (self.interrupt is None or self._suspended is not None or not sched.num_prefill_tokens
                or self.scheduler.granularity is not Granularity.LAYER or not self.scheduler.preemption_on):
            return None
        # Urgent = above the lowest priority among the heavy (prefill) chunks this forward carries.
        floor = min(c.request.priority for c in sched.chunks if c.num_tokens > 1)
        return lambda layer: self.interrupt(floor)

    def _finish_suspended(self) -> list[RequestOutput]:
        """Run the rest of a suspended forward and hand out its tokens (a step of its own)."""
        sus, self._suspended = self._suspended, None
        t0 = time.perf_counter()
        logits = self.runner.resume(sus.checkpoint, between=self._layer_hook(None))
        forward_s = time.perf_counter() - t0
        self._events.append(LayerResume(layer=sus.checkpoint.next_layer,
                                        request_ids=[r.request_id for r in sus.requests]))
        outputs = self._update(sus.sched, logits)
        sus.sched.decision_s = 0.0
        sus.sched.preemptions, sus.sched.moves, sus.sched.preempted_ids = [], [], []
        # Its admissions' prefix look-ups were counted in the step that suspended.
        sus.sched.num_prefix_query_tokens = sus.sched.num_prefix_hit_tokens = sus.sched.num_prefix_repeat_tokens = 0
        self._record(sus.sched, t0, forward_s, 0.0, outputs)
        return outputs

    def _record(self, sched: SchedulerOutput, t0: float, forward_s: float, swap_s: float,
                outputs: list[RequestOutput]) -> None:
        t2 = time.perf_counter()
        events, self._events = self._events, []
        self.telemetry.record(
            StepRecord(
                step_id=sched.step_id,
                model=self.name,
                t=time.time(),
                wall_s=t2 - t0,
                forward_s=forward_s,
                sample_s=max(0.0, t2 - t0 - forward_s - sched.decision_s - swap_s),
                swap_s=swap_s,
                decision_s=sched.decision_s,
                num_prefill_tokens=sched.num_prefill_tokens,
                num_decode_tokens=sched.num_decode_tokens,
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                kv_blocks_used=self.pool.num_used,
                kv_blocks_total=self.pool.num_blocks,
                num_preempted=len(sched.preempted_ids),
                preempted_ids=list(sched.preempted_ids),
                num_finished=sum(o.finished for o in outputs),
                preemptions=[Victim.from_json(p.to_dict()).to_json() for p in sched.preemptions],
                swaps=[m.event().to_json() for m in sched.moves],
                events=events,
                preemption_on=self.scheduler.preemption_on,
                kv_host_blocks_used=self.host_pool.num_used,
                kv_host_blocks_total=self.host_pool.num_blocks,
                kv_blocks_reserved=sched.kv_blocks_reserved,
                num_prefix_query_tokens=sched.num_prefix_query_tokens,
                num_prefix_hit_tokens=sched.num_prefix_hit_tokens,
                num_prefix_repeat_tokens=sched.num_prefix_repeat_tokens,
                prefix_caching=self.scheduler.kv.prefix.enabled,
            )
        )

    def _update(self, sched: SchedulerOutput, result: torch.Tensor | DecodeResult,
                filled: tuple | None = None) -> list[RequestOutput]:
        """Sample from the forward's logits [S, V] (or take a fixed-shape step's DecodeResult, chosen on the
        device) and hand out the tokens. filled: the grammar masks computed beside the forward (None: here)."""
        sampling = [c.request for c in sched.chunks if c.sample]
        if not isinstance(result, DecodeResult) and result.shape[0] > len(sampling):
            prompt_logprobs.record(sched.chunks, result[len(sampling):])
            result = result[:len(sampling)]
        for c in sched.chunks:
            c.request.advance(c.num_tokens)
        stops: list[bool | None] = [None] * len(sampling)
        sampled = SamplerOutput([], [])
        if isinstance(result, DecodeResult) and all(
                r.params.plain_greedy or (result.sampled and r.params.plain_sampling) for r in sampling):
            ids, stops = result.host()  # chosen on the device: one small copy
            sampled = SamplerOutput(ids, [None] * len(ids))
        elif sampling:
            bitmask, masked = filled if filled is not None else self.grammars.fill(sampling)
            logits, greedy = (result.logits, result.greedy) if isinstance(result, DecodeResult) else (result, None)
            sampled = self.rows.sample(logits, sampling, self.eos_token_ids, bitmask, masked, greedy_ids=greedy)
        # A row that raised alone (engine/row_failures.py) ends its request as an abort; the others go on.
        outputs = [self.abort(r.request_id) for r, t in zip(sampling, sampled.token_ids) if t is None]
        return outputs + self._hand_out(sampling, sampled.token_ids, sampled.logprobs, stops)

    def _hand_out(self, reqs: list[Request], token_ids: list, logprobs: list, stops: list) -> list[RequestOutput]:
        """Append each request's new token (None: skipped) and finish the ones it ends; their outputs."""
        now = time.monotonic()
        outputs = []
        for req, tok, lp, stop in zip(reqs, token_ids, logprobs, stops):
            if tok is None:
                continue
            req.output_token_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._stop_reason(req, tok, stop)
            if reason is not None:
                self.scheduler.remove(req)
                switch = self.scheduler.auto.observe(
                    len(req.output_token_ids),
                    [len(r.output_token_ids) for r in self.requests.values() if r is not req])
                if switch is not None and self.scheduler.mode.value == "auto":
                    self._events.append(switch)
                self.requests.pop(req.request_id, None)
                state = RequestState.FINISHED_STOPPED if reason is FinishReason.STOP else RequestState.FINISHED_LENGTH
                outputs.append(self._finish(req, state, reason, tok, lp))
            else:
                outputs.append(self._output(req, [tok], lp))
        return outputs

    def _stop_reason(self, req: Request, tok: int, stopped: bool | None = None) -> FinishReason | None:
        """stopped: the device's verdict on tok against step_rows.stop_ids (None: check here)."""
        p = req.params
        if stopped is None:
            stopped = (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids
        # A grammar that is complete (or that the token broke) ends the output here, with the token's text.
        grammar_done = req.grammar is not None and self.grammars.advance(req, tok)
        if p.detokenize and not stopped:
            stopped = detokenizer.step(self.tokenizer, req, tok) is not None
        stopped = stopped or grammar_done
        if stopped:
            return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, state: RequestState, reason: FinishReason, tok: int | None = None,
                lp: TokenLogprobs | None = None):
        req.state = state
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        self.grammars.release(req)
        return self._output(req, [tok] if tok is not None else [], lp)

    def _output(self, req: Request, new_ids: list[int], lp: TokenLogprobs | None = None) -> RequestOutput:
        finished = req.state.is_finished
        text = detokenizer.take_new_text(req, finished) if req.params.detokenize else ""
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=text,
            finished=finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            logprobs=[lp] if lp is not None else None,
            scheduled_time=req.scheduled_time,
            prompt_logprobs=prompt_logprobs.take(req, bool(new_ids) or finished),
        )

    # -- offline convenience ---------------------------------------------
    def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        """Run one request (alongside whatever else is queued) and yield its RequestOutputs."""
        return offline.stream(self, request_id, prompt_token_ids, params)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion together; returns the output token ids per prompt."""
        return offline.generate(self, prompts, params)


class _Suspended:
    """A forward stopped between layers, waiting for the urgent step to pass."""

    def __init__(self, sched: SchedulerOutput, checkpoint: LayerCheckpoint, requests: list[Request], forward_s: float):
        self.sched = sched
        self.checkpoint = checkpoint
        self.requests = requests
        self.forward_s = forward_s
        self.served = False  # the urgent step has run

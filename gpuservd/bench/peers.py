"""The peer systems gpuserv is measured against, both on Hugging Face transformers.

- `hf_static`: `model.generate` on static batches of `max_num_seqs` requests in
  arrival order, left padded; each batch runs to its longest output.
- `hf_continuous`: transformers' own continuous batching
  (`model.init_continuous_batching()`), requests submitted at their arrival times.

Both use the same local model directory, dtype and torch thread count as
gpuserv, greedy decoding and forced output lengths (EOS can never stop a
request early), and each is warmed up before the clock starts. Each checks
that every request really got `output_tokens` tokens and raises if not: a peer
that stops early would make gpuserv look slower than it is.

torch and transformers are imported inside the functions so that importing
this module (e.g. for `--peers none`) costs nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from gpuservd.bench.floor import ForeignLoad
from gpuservd.bench.records import RequestTiming, SystemRun

# torch and transformers are imported inside the functions that run a peer: reports and the socket
# benchmark import this module on machines and paths that never load a model (test_bench_report.py).

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
          "fp16": "float16", "half": "float16"}


def torch_dtype(dtype):
    """A torch dtype from a name ("float32", "bf16", ...) or a torch dtype."""
    import torch  # here: reports import this module without a model (the note above DTYPES)

    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return getattr(torch, DTYPES[str(dtype).lower()])
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}") from None


def load_peer_model(model_dir, dtype, num_threads: int | None = None):
    """The transformers model in `model_dir`, in eval mode on the CPU, with torch's thread count set."""
    import torch  # here: reports import this module without a model (the note above DTYPES)
    from transformers import AutoModelForCausalLM

    if num_threads:
        torch.set_num_threads(int(num_threads))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype(dtype))
    return model.eval()


def _pad_id(model) -> int:
    """The pad id generate needs: the model's pad, else its (first) EOS, else 0."""
    cfg = model.config
    for cand in (getattr(cfg, "pad_token_id", None), getattr(cfg, "eos_token_id", None)):
        cand = (cand or [None])[0] if isinstance(cand, list) else cand
        if cand is not None and cand >= 0:
            return int(cand)
    return 0


class _StepClock:
    """A generate() streamer that only timestamps: put() is called once with the prompt and
    then once per generated token (right after it is selected), so stamps[k-1] is when token k existed."""

    def __init__(self):
        self.stamps: list[float] = []  # perf_counter when token k (1-based) of every row was chosen
        self._seen_prompt = False  # the first put() carries the prompt, not a token

    def put(self, value) -> None:
        self.stamps += [time.perf_counter()] if self._seen_prompt else []
        self._seen_prompt = True

    def end(self) -> None:  # the streamer protocol's last call; nothing to flush
        pass


def _left_pad(batch: Sequence, pad_id: int):
    """input_ids and attention_mask for a batch of token-id lists, padded on the left."""
    import torch  # here: reports import this module without a model (the note above DTYPES)

    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[row, width - len(r.prompt_token_ids):] = 1
    return ids, mask


def _generate(model, batch: Sequence, new_tokens: int, pad_id: int, clock: _StepClock | None = None):
    """One static batch through generate: greedy, exactly `new_tokens` tokens for every row
    (min_new_tokens = max_new_tokens masks EOS at every step, so nothing stops early)."""
    import torch  # here: reports import this module without a model (the note above DTYPES)
    from transformers import GenerationConfig

    ids, mask = _left_pad(batch, pad_id)
    gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           num_beams=1, pad_token_id=pad_id, eos_token_id=_eos_ids(model))
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen, streamer=clock)
    return out.shape[1] - ids.shape[1]


def _eos_ids(model) -> list[int] | None:
    eos = getattr(model.generation_config, "eos_token_id", None) or getattr(model.config, "eos_token_id", None)
    return [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None and e >= 0] or None


def _sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.perf_counter()))


def run_hf_static(model_dir, requests: Sequence, dtype="float32", max_num_seqs: int = 32, *,
                  num_threads: int | None = None, model=None) -> SystemRun:
    """Run `requests` (WorkloadRequests) on transformers `generate` with static batches.

    Batches are the next `max_num_seqs` requests in arrival order; a batch starts when the
    previous one is done and its last request has arrived. `first_token_s` is when the
    request's first token was produced; `finish_s` is the batch end, since a static server
    returns a batch all at once (when each request's last token was produced is kept in
    `extra["logical_finish_s"]`). Pass `model` to reuse an already loaded one."""
    model = model if model is not None else load_peer_model(model_dir, dtype, num_threads)
    pad_id = _pad_id(model)
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    if reqs:  # warm-up: the first call of each kernel is slow; not timed
        _generate(model, reqs[: min(2, len(reqs))], 2, pad_id)
    timings, logical, batches = [], {}, []
    load = ForeignLoad().start()
    t0 = time.perf_counter()
    for start in range(0, len(reqs), max_num_seqs):
        batch = reqs[start:start + max_num_seqs]
        _sleep_until(t0 + max(r.arrival_s for r in batch))
        new_tokens = max(r.output_tokens for r in batch)
        clock = _StepClock()
        b0 = time.perf_counter()
        produced = _generate(model, batch, new_tokens, pad_id, clock)
        b1 = time.perf_counter()
        if produced != new_tokens or len(clock.stamps) != new_tokens:
            raise RuntimeError(f"hf_static: batch made {produced} tokens ({len(clock.stamps)} steps), "
                               f"expected {new_tokens}")
        for r in batch:
            logical[r.request_id] = clock.stamps[r.output_tokens - 1] - t0
            timings.append(RequestTiming(
                request_id=r.request_id, cls=r.cls, arrival_s=r.arrival_s,
                first_token_s=clock.stamps[0] - t0, finish_s=b1 - t0,
                prompt_tokens=len(r.prompt_token_ids), output_tokens=r.output_tokens))
        decode = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
        batches.append({
            "size": len(batch), "padded_prompt": max(len(r.prompt_token_ids) for r in batch),
            "new_tokens": new_tokens, "start_s": b0 - t0, "end_s": b1 - t0,
            "prefill_s": clock.stamps[0] - b0,
            "decode_step_ms_mean": 1000 * sum(decode) / len(decode) if decode else None,
            "wasted_tokens": sum(new_tokens - r.output_tokens for r in batch),
        })
    load.stop()
    wall = max((t.finish_s for t in timings), default=0.0)
    extra = {
        "finish_semantics": "finish_s is the batch end: a static server returns a whole batch at once; "
                            "logical_finish_s has when each request's last token was produced",
        "logical_finish_s": logical,
        "batches": batches,
        **_common_extra(dtype, max_num_seqs, load, reqs, timings),
    }
    return SystemRun(system="hf_static", wall_s=wall, requests=timings, extra=extra)


def _common_extra(dtype, max_num_seqs: int, load: ForeignLoad, reqs: Sequence, timings: list) -> dict:
    import torch  # here: reports import this module without a model (the note above DTYPES)

    expected, counted = sum(r.output_tokens for r in reqs), sum(t.output_tokens for t in timings)
    return {"token_check": {"expected": expected, "counted": counted, "ok": expected == counted},
            "max_num_seqs": max_num_seqs, "dtype": str(torch_dtype(dtype)).removeprefix("torch."),
            "num_threads": torch.get_num_threads(), "foreign_cpu_share": load.share}



def _cb_config(requests: Sequence, max_num_seqs: int, token_budget: int):
    """A ContinuousBatchingConfig sized for this workload. Left alone, transformers sizes the KV
    cache from free memory (60% of the host's RAM on a CPU) and allocates it all up front."""
    # here: reports import this module without a model (the note above DTYPES)
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 64
    longest = max(len(r.prompt_token_ids) + r.output_tokens for r in requests)
    # Room for max_num_seqs requests of the longest length at once (+1 page each for rounding),
    # over 0.8: the FIFO scheduler stops admitting new requests when less than 15% is free.
    num_blocks = int(max_num_seqs * (-(-longest // page) + 1) / 0.8) + 1
    return ContinuousBatchingConfig(
        page_size=page, num_blocks=num_blocks, max_batch_tokens=token_budget,
        max_requests_per_batch=max_num_seqs, allow_block_sharing=False, seed=0,
    )


def run_hf_continuous(model_dir, requests: Sequence, dtype="float32", max_num_seqs: int = 32, *,
                      num_threads: int | None = None, model=None, token_budget: int = 2048,
                      timeout_s: float = 3600.0) -> SystemRun:
    """Run `requests` on transformers' continuous batching, each submitted at its arrival offset.

    The manager's loop runs in its own thread; a feeder thread submits requests on time and
    this thread collects the results. `first_token_s` / `finish_s` are the per-token
    timestamps transformers records (`record_timestamps=True`) when it appends the token.
    `token_budget` is transformers' `max_batch_tokens` (tokens per forward pass)."""
    import torch  # here: reports import this module without a model (the note above DTYPES)
    from transformers import GenerationConfig

    model = model if model is not None else load_peer_model(model_dir, dtype, num_threads)
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    if not reqs:  # nothing to time (and the warm-up below needs a prompt)
        return SystemRun(system="hf_continuous", wall_s=0.0, requests=[], extra={})
    # eos_token_id=-1 disables EOS in transformers' CB: every request runs to max_new_tokens.
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=_pad_id(model),
                           max_new_tokens=max(r.output_tokens for r in reqs))
    cb = _cb_config(reqs, max_num_seqs, token_budget)
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        attn = model.config._attn_implementation  # what CB switched to (it restores the original on stop)
        manager.warmup()  # captures graphs on CUDA; a no-op on the CPU
        manager.start()
        try:
            # Warm-up through the running loop: the first forward of each shape is slow; not timed.
            warm = {f"warmup-{i}": r for i, r in enumerate(reqs[:2])}
            for rid, r in warm.items():
                _submit(manager, rid, r.prompt_token_ids[:8], 2)
            _collect(manager, set(warm), timeout_s, [])
            feeder_errors: list[BaseException] = []
            with ForeignLoad() as load:
                t0 = time.perf_counter()
                feeder = threading.Thread(target=_feed, args=(manager, reqs, t0, feeder_errors), daemon=True)
                feeder.start()
                results = _collect(manager, {r.request_id for r in reqs}, timeout_s, feeder_errors)
                feeder.join()
            resolved = manager.continuous_batching_config
        except BaseException:
            manager.stop(block=True, timeout=60, hard_stop=True)  # don't flush work nobody will read
            raise
        manager.stop(block=True, timeout=60)
    timings, mismatches = [], []
    for r in reqs:
        out = results[r.request_id]
        n = len(out.generated_tokens)
        if n != r.output_tokens or not out.timestamps:
            mismatches.append((r.request_id, r.output_tokens, n))
            continue
        timings.append(RequestTiming(
            request_id=r.request_id, cls=r.cls, arrival_s=r.arrival_s,
            first_token_s=out.timestamps[0] - t0, finish_s=out.timestamps[-1] - t0,
            prompt_tokens=len(r.prompt_token_ids), output_tokens=n))
    if mismatches:
        raise RuntimeError(f"hf_continuous: wrong output lengths (id, expected, got): {mismatches[:5]}")
    extra = {
        "cb_config": {k: getattr(resolved, k) for k in (
            "page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "scheduler_type",
            "use_async_batching", "use_cuda_graph", "allow_block_sharing")},
        "attn_implementation": attn,
        **_common_extra(dtype, max_num_seqs, load, reqs, timings),
    }
    wall = max(t.finish_s for t in timings)
    return SystemRun(system="hf_continuous", wall_s=wall, requests=timings, extra=extra)


def _feed(manager, reqs: Sequence, t0: float, errors: list) -> None:
    """Submit each request at t0 + its arrival offset (all at once for a burst); a failure
    lands in `errors` for the collecting thread to raise."""
    try:
        for r in reqs:
            _sleep_until(t0 + r.arrival_s)
            _submit(manager, r.request_id, r.prompt_token_ids, r.output_tokens)
    except BaseException as e:  # noqa: BLE001 - handed over to the main thread
        errors.append(e)


def _submit(manager, request_id: str, prompt_token_ids: Sequence[int], output_tokens: int) -> None:
    # record_timestamps gives per-token times without streaming every token through the queue.
    added = manager.add_request(list(prompt_token_ids), request_id=request_id, max_new_tokens=output_tokens,
                                record_timestamps=True, eos_token_id=-1)
    if added is None:
        raise RuntimeError(f"hf_continuous refused request {request_id}")


def _collect(manager, request_ids: set, timeout_s: float, feeder_errors: list) -> dict:
    """Wait until every request in `request_ids` has finished; their outputs by id."""
    done, deadline = {}, time.perf_counter() + timeout_s
    while len(done) < len(request_ids):
        if feeder_errors:
            raise feeder_errors[0]
        out = manager.get_result(timeout=1.0)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("hf_continuous: transformers' generation thread died (see its log above)")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"hf_continuous: {len(request_ids) - len(done)} requests unfinished after {timeout_s}s")
            continue
        if out.error is not None:
            raise RuntimeError(f"hf_continuous: request {out.request_id} failed: {out.error}")
        if out.is_finished() and out.request_id in request_ids:
            done[out.request_id] = out
    return done

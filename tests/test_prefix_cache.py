"""Automatic prefix caching: exact tokens with the cache on, what it reuses, and no block written or
leaked under sharing, eviction, swap and recompute (a simulated KV content check over random traffic)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import arrive_and_cancel
from gpuservd.config import EngineConfig, PreemptionConfig, SchedulerConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import Request, SamplingParams
from gpuservd.engine.scheduler import KVLayout, Scheduler
from gpuservd.kv_cache.block_pool import BlockPool
from gpuservd.kv_cache.manager import KVCacheManager

PARAMS = dict(ignore_eos=True, detokenize=False)


def engine(model_dir, caching=True, num_blocks=None, name="tiny", **pre) -> LLMEngine:
    sched = pre.pop("scheduler", {})
    cfg = EngineConfig(model=name, block_size=4, kv_cache_bytes=4 << 20, prefix_caching=caching,
                       preemption=PreemptionConfig(min_exec_s=0, **pre))
    for k, v in sched.items():
        setattr(cfg.scheduler, k, v)
    if num_blocks:
        cfg.kv_cache_bytes = num_blocks * LLMEngine(name, model_dir, cfg).runner.cache.shape.bytes_per_block
    return LLMEngine(name, model_dir, cfg)


def shared_prompts(n=4, prefix_len=26, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 290, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 290, (3 + 2 * i,), generator=g).tolist() for i in range(n)]


def waves(eng, prompts, max_tokens=10):
    """The first prompt alone, then the rest together: the rest can share its prefix blocks."""
    p = SamplingParams(max_tokens=max_tokens, **PARAMS)
    return eng.generate(prompts[:1], p) + eng.generate(prompts[1:], p)


def hits(eng) -> int:
    return sum(s.num_prefix_hit_tokens for s in eng.telemetry.recent())


def test_shared_prefix_batch_gives_the_same_tokens_and_reuses_the_prefix(tiny_model_dir):
    ps = shared_prompts()
    off = engine(tiny_model_dir, caching=False)
    on = engine(tiny_model_dir)
    assert waves(on, ps) == waves(off, ps)
    assert hits(off) == 0 and hits(on) == 3 * 24  # 6 full blocks of the 26-token prefix, for each of 3
    st = on.prefix_cache_status()
    assert st["enabled"] and st["hit_tokens"] == 72 and st["query_tokens"] == sum(len(p) for p in ps)
    assert on.pool.num_free == on.pool.num_blocks and on.pool.num_cached > 0  # cached, nobody holds them
    # The telemetry sees a smaller prefill for the same prompts.
    prefill = lambda e: sum(s.num_prefill_tokens for s in e.telemetry.recent())  # noqa: E731
    assert prefill(on) < prefill(off)


def test_a_prompt_cached_in_full_still_computes_its_last_token(tiny_model_dir):
    """A 24-token prompt fills 6 blocks; asked again, 5 come from the cache and the 6th is computed
    again (into a block of its own) for the logits of the first new token."""
    prompt = shared_prompts(1, prefix_len=24)[0][:24]
    off = engine(tiny_model_dir, caching=False)
    on = engine(tiny_model_dir)
    p = SamplingParams(max_tokens=6, **PARAMS)
    ref = off.generate([prompt], p)
    assert on.generate([prompt], p) == ref and on.generate([prompt], p) == ref
    assert hits(on) == 20


def test_identical_prompts_admitted_together_share_their_blocks(tiny_model_dir):
    """n copies of one prompt arriving in one step (n > 1): the copies wait while the first computes a
    block they would share, then take it from the cache instead of computing it again."""
    prompt = shared_prompts(1, prefix_len=30)[0]
    off = engine(tiny_model_dir, caching=False)
    on = engine(tiny_model_dir, scheduler=dict(max_prefill_tokens=64))
    p = SamplingParams(max_tokens=8, **PARAMS)
    assert on.generate([prompt] * 3, p) == off.generate([prompt] * 3, p)
    full = (len(prompt) - 1) // 4 * 4
    assert hits(on) == 2 * full


@pytest.mark.parametrize("kind", ["swap", "partial_swap", "recompute"])
def test_preempting_a_request_that_shares_blocks_is_exact(tiny_model_dir, kind):
    """A small pool forces preemptions of requests holding shared prefix blocks: a swap copies them
    (the others keep reading them), a partial swap parks only in blocks the victim alone holds, a
    recompute drops only the victim's references. Tokens equal the cache-off run, nothing leaks."""
    ps = shared_prompts(4, prefix_len=18)
    ref = waves(engine(tiny_model_dir, caching=False), ps, max_tokens=14)
    eng = engine(tiny_model_dir, num_blocks=18, mode="on", kind=kind, partial_keep_fraction=0.34)
    assert waves(eng, ps, max_tokens=14) == ref
    pre = [p for s in eng.telemetry.recent() for p in s.preemptions]
    assert pre and {p["kind"] for p in pre} <= {kind, "swap"} and hits(eng) > 0
    assert eng.pool.num_free == eng.pool.num_blocks and eng.host_pool.num_used == 0


def test_a_variant_never_reuses_the_bases_blocks():
    """Blocks hash in the namespace of their weights: one pool, two namespaces, no hit across them."""
    pool = BlockPool(16)
    base = KVCacheManager(pool, 4, prefix_caching=True, namespace="base")
    variant = KVCacheManager(pool, 4, prefix_caching=True, namespace="base+delta")
    r = Request("a", list(range(20)), SamplingParams())
    base.allocate_slots(r, 20)
    r.num_computed_tokens = 20
    base.free(r)
    assert pool.num_cached == 5
    again = Request("b", list(range(20)), SamplingParams())
    assert base.find_cached_prefix(again).num_tokens == 16
    assert variant.find_cached_prefix(Request("c", list(range(20)), SamplingParams())) is None


def test_engines_of_different_models_hash_apart(tiny_model_dir):
    a, b = engine(tiny_model_dir, name="tiny"), engine(tiny_model_dir, name="tiny-lora")
    r = Request("x", list(range(8)), SamplingParams())
    assert a.scheduler.kv.prefix.hashes(r, 2) != b.scheduler.kv.prefix.hashes(r, 2)


def test_caching_off_counts_what_a_cache_would_have_reused(tiny_model_dir):
    """The hint's evidence: with caching off, step records count the repeated prefix tokens."""
    off = engine(tiny_model_dir, caching=False)
    waves(off, shared_prompts())
    recs = off.telemetry.recent()
    assert sum(s.num_prefix_repeat_tokens for s in recs) == 3 * 24 and not any(s.prefix_caching for s in recs)
    assert off.prefix_cache_status()["repeat_tokens"] == 72 and hits(off) == 0


def test_reset_drops_the_cache(tiny_model_dir):
    eng = engine(tiny_model_dir)
    ps = shared_prompts(2)
    p = SamplingParams(max_tokens=4, **PARAMS)
    eng.generate(ps[:1], p)
    assert eng.reset_prefix_cache() > 0 and eng.pool.num_cached == 0
    eng.generate(ps[1:], p)
    assert hits(eng) == 0 and eng.prefix_cache_status()["resets"] == 1


# -- the manager under random traffic, with a simulated KV content --------------------------------


class SimKV:
    """What each device slot holds: (token, position) of the request that wrote it, or None. Host blocks
    hold copies. Every chunk's attention reads are checked against the reader's own tokens."""

    def __init__(self, s: Scheduler):
        self.s = s
        self.dev: dict[tuple[int, int], tuple[int, int] | None] = {}
        self.host: dict[int, list] = {}

    def run_moves(self, moves):
        bs = self.s.block_size
        for m in moves:
            if m.direction == "out":
                for b, hb in zip(m.device_blocks, m.host_blocks):
                    self.host[hb] = [self.dev.get((b, o)) for o in range(bs)]
                for b in m.park_blocks:  # parking overwrites these blocks' slots with packed layers
                    for o in range(bs):
                        self.dev[(b, o)] = None
            else:
                for b, hb in zip(m.device_blocks, m.host_blocks):
                    for o in range(bs):
                        self.dev[(b, o)] = self.host[hb][o]

    def forward(self, chunks):
        bs, pool, kv = self.s.block_size, self.s.pool, self.s.kv
        for c in chunks:
            table, r = kv.table(c.request), c.request
            tokens = r.prompt_token_ids + r.output_token_ids
            for p in range(c.start_pos, c.start_pos + c.num_tokens):
                b = table[p // bs]
                assert pool.refcount(b) == 1 and pool.hash_of(b) is None, "a shared or cached block was written"
                self.dev[(b, p % bs)] = (tokens[p], p)
        for c in chunks:
            table, r = kv.table(c.request), c.request
            tokens = r.prompt_token_ids + r.output_token_ids
            for p in range(c.start_pos + c.num_tokens):
                assert self.dev.get((table[p // bs], p % bs)) == (tokens[p], p), (r.request_id, p)


def _check_accounting(s: Scheduler):
    refs: dict[int, int] = {}
    for r in s.running + s.waiting:
        kv = s.kv._kv.get(r.request_id)
        if kv is None:
            continue
        for b in kv.table + (kv.swapped.park_blocks if kv.swapped else []):
            refs[b] = refs.get(b, 0) + 1
    for b in range(s.pool.num_blocks):
        assert s.pool.refcount(b) == refs.get(b, 0), f"block {b}: refcount {s.pool.refcount(b)}, held {refs.get(b, 0)}"
    assert s.pool.num_used == len(refs)
    assert s.host.num_used == sum(s.kv.num_host_blocks(r) for r in s.waiting)


@settings(max_examples=120, deadline=None)
@given(
    num_blocks=st.integers(8, 24),
    max_num_seqs=st.integers(1, 6),
    prefill_budget=st.integers(1, 16),
    mode=st.sampled_from(["off", "on"]),
    kind=st.sampled_from(["auto", "swap", "partial_swap", "recompute"]),
    host_blocks=st.integers(0, 30),
    reqs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9), st.integers(1, 10), st.integers(0, 4),
                            st.integers(0, 1)), min_size=1, max_size=14),
    # (shared prefix id, private tokens, max_tokens, arrival step, priority)
    cancel=st.sets(st.integers(0, 13), max_size=2),
    reset_at=st.integers(0, 40),
)
def test_property_sharing_eviction_swap_no_leak_no_shared_write(num_blocks, max_num_seqs, prefill_budget, mode,
                                                               kind, host_blocks, reqs, cancel, reset_at):
    s = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(24, max_num_seqs),
                                  max_prefill_tokens=prefill_budget, policy="priority"),
                  BlockPool(num_blocks), 4,
                  PreemptionConfig(min_exec_s=0, max_preemptions=2, mode=mode, kind=kind, partial_keep_fraction=0.5,
                                   outrank_ratio=2.0),
                  host_pool=BlockPool(host_blocks) if host_blocks else None, layout=KVLayout(4, 4096),
                  prefix_caching=True, namespace="m")
    if s.host is None:
        s.host = s.kv.host = BlockPool(1)  # accounting below reads it; nothing can swap into one block
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [4, 4, 4, 4, 4]]
    requests = [Request(f"r{i}", prefixes[pid] + [20 + i] * extra, SamplingParams(max_tokens=m), priority=pr,
                        arrival_time=i)
                for i, (pid, extra, m, _, pr) in enumerate(reqs)]
    arrivals = {i: a for i, (_, _, _, a, _) in enumerate(reqs)}
    sim, done, step = SimKV(s), [], 0
    while len(done) < len(requests):
        arrive_and_cancel(s, requests, arrivals, cancel, step, done)
        if step == reset_at:
            s.kv.reset_prefix_cache()
        out = s.schedule()
        sim.run_moves(out.moves)
        sim.forward(out.chunks)
        for c in out.chunks:
            c.request.advance(c.num_tokens)
        for c in out.chunks:
            if c.sample:
                c.request.output_token_ids.append(30 + len(c.request.output_token_ids))
                if len(c.request.output_token_ids) >= c.request.params.max_tokens:
                    s.remove(c.request)
                    done.append(c.request)
        step += 1
        assert step < 3000, "no progress"
        _check_accounting(s)
    assert s.pool.num_used == 0 and s.pool.num_free == s.pool.num_blocks and s.host.num_used == 0
    assert not s.kv._kv and not s.kv.prefix._hashes  # nothing kept for requests that are gone


def test_a_recompute_keeping_its_tail_takes_its_dropped_blocks_back_from_the_cache():
    """Recompute drops a victim's oldest blocks; they stay cached (nobody took them), so when it resumes
    it shares all but the last of them again and rebuilds only that one block before its kept tail."""
    from gpuservd.engine.schedule_output import SchedulerOutput

    s = Scheduler(SchedulerConfig(), BlockPool(32), 4, PreemptionConfig(mode="on", kind="recompute", min_exec_s=0),
                  layout=KVLayout(4, 4096), prefix_caching=True)
    r = Request("a", list(range(1, 25)), SamplingParams(max_tokens=8))
    s.add(r)
    assert s.schedule().chunks[0].num_tokens == 24
    r.advance(24)
    r.output_token_ids.append(99)
    table = list(s.kv.table(r))
    out = SchedulerOutput(step_id=0)
    s._preempt(r, out, need=3, reason="test")
    assert out.preemptions[0].kind == "recompute" and out.preemptions[0].tokens_to_recompute == 12
    assert r.rebuild is not None and s.kv.table(r) == table[3:]
    out = s.schedule()
    (c,) = out.chunks
    assert (c.start_pos, c.num_tokens) == (8, 4) and out.num_prefix_hit_tokens == 8 and out.num_prefix_query_tokens == 12
    assert s.kv.table(r)[:2] == table[:2] and s.kv.table(r)[3:] == table[3:]
    r.advance(4)
    assert r.num_computed_tokens == 24 and r.rebuild is None  # back on its kept tail
    s.remove(r)
    assert s.pool.num_used == 0

"""The KV cache manager: the one owner of every request's KV blocks.

A request's KV is in one of three shapes, and only this module changes them:
- resident: a device block table (`table`), one block per `block_size` tokens;
- partly dropped (recompute keeping a tail): the oldest blocks were given back
  and `allocate_slots` puts fresh ones in front of the kept tail on resume;
- swapped: some layers of its blocks in host blocks, the other layers packed
  ("parked") into a few device blocks (partial swap; none for a full swap).

Mechanism only, as vLLM's KVCacheManager: it answers how many blocks something
needs, hands out blocks or None, and returns the copies (`KVMove`) a swap needs,
which the engine executes in order before the step's forward. Who is preempted,
and whether by swap, partial swap or recompute, is the scheduler's decision.

With prefix caching (kv_cache/prefix_cache.py) a block may be in several
tables at once. A shared block is never written or moved out from under its
other holders: only full blocks are shared and a request writes only past its
computed tokens; a partial swap parks its kept layers only in blocks it alone
references (uncached first, as their content changes); swap-outs copy shared
blocks (reading is safe) and every preemption only drops this request's
reference, so "blocks freed" counts the blocks whose last reference went.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuservd.kv_cache.block_pool import BlockPool
from gpuservd.kv_cache.prefix_cache import CachedPrefix, PrefixCache
from gpuservd.kv_cache.swap import KVMove, num_park_blocks


@dataclass
class SwappedKV:
    """A swapped-out request's KV: layers [0, num_host_layers) of its `num_blocks` blocks are in
    `host_blocks` (one per block), the other layers packed into `park_blocks` on the device."""

    num_blocks: int  # length of its block table when it left
    num_host_layers: int
    host_blocks: list[int]
    park_blocks: list[int]  # empty for a full swap


@dataclass
class RequestKV:
    """What the manager holds for one request."""

    table: list[int] = field(default_factory=list)  # device block table, in token order
    num_dropped: int = 0  # oldest blocks dropped by a recompute; `table` is then the kept tail
    swapped: SwappedKV | None = None
    num_committed: int = 0  # leading table blocks already offered to the prefix cache


class KVCacheManager:
    """Owns the device block pool's and the host pool's blocks of every request of one engine.

    `pool` is the device BlockPool; `host` anything with allocate/free/num_free/num_used (the
    engine's HostKVPool, or a bare BlockPool in scheduler tests), or None when there is no swap space.
    `namespace` names the weights the KV belongs to (prefix cache hashes are only equal within one)."""

    def __init__(self, pool: BlockPool, block_size: int, host=None, num_layers: int = 1,
                 prefix_caching: bool = False, namespace: str = ""):
        self.pool = pool
        self.host = host
        self.block_size = block_size
        self.num_layers = num_layers
        self.prefix = PrefixCache(pool, block_size, prefix_caching, namespace)
        self._kv: dict[str, RequestKV] = {}

    # -- questions ---------------------------------------------------------
    def _get(self, request) -> RequestKV:
        kv = self._kv.get(request.request_id)
        if kv is None:
            kv = self._kv[request.request_id] = RequestKV()
        return kv

    def table(self, request) -> list[int]:
        """The request's device block table (what the runner reads); empty while swapped."""
        kv = self._kv.get(request.request_id)
        return kv.table if kv is not None else []

    def num_table_blocks(self, request) -> int:
        return len(self.table(request))

    def num_device_blocks(self, request) -> int:
        """Device blocks it holds: its table, or its parked layers while swapped."""
        kv = self._kv.get(request.request_id)
        if kv is None:
            return 0
        return len(kv.table) + (len(kv.swapped.park_blocks) if kv.swapped else 0)

    def num_host_blocks(self, request) -> int:
        kv = self._kv.get(request.request_id)
        return len(kv.swapped.host_blocks) if kv is not None and kv.swapped else 0

    def holds_kv(self, request) -> bool:
        """Whether it has any KV: blocks, a kept tail, parked or host blocks."""
        kv = self._kv.get(request.request_id)
        return kv is not None and bool(kv.table or kv.swapped or kv.num_dropped)

    def blocks_to_hold(self, request, num_new: int, prefix: CachedPrefix | None = None) -> int:
        """Blocks its table gains for the next num_new tokens, shared ones included (what a tenant's
        KV block quota charges it: every block a request references counts, shared or not)."""
        kv = self._kv.get(request.request_id)
        if prefix is None or (kv is not None and kv.num_dropped):
            return self.blocks_needed(request, num_new)  # a dropped prefix: its dropped blocks, shared or not
        return self._num_blocks_for(prefix.num_tokens + num_new)

    def _num_evictable(self, prefix: CachedPrefix) -> int:
        """Blocks of a cached prefix nobody references now (sharing takes them out of the free queue)."""
        return sum(1 for b in prefix.blocks if self.pool.refcount(b) == 0)

    def is_swapped(self, request) -> bool:
        kv = self._kv.get(request.request_id)
        return kv is not None and kv.swapped is not None

    @property
    def num_host_free(self) -> int:
        return self.host.num_free if self.host is not None else 0

    def blocks_needed(self, request, num_new: int, prefix: CachedPrefix | None = None) -> int:
        """Device blocks `allocate_slots(request, num_new, prefix)` (or `swap_in`) would take from the
        pool: fresh ones, and cached ones nobody references that the prefix would take out of the free queue."""
        kv = self._kv.get(request.request_id)
        if prefix is not None:
            if kv is not None and kv.num_dropped:
                fresh = kv.num_dropped - len(prefix.blocks)
            else:
                fresh = self._num_blocks_for(prefix.num_tokens + num_new) - len(prefix.blocks)
            return fresh + self._num_evictable(prefix)
        if kv is not None and kv.swapped is not None:
            s = kv.swapped
            return s.num_blocks - len(s.park_blocks) + self._growth(request, s.num_blocks, num_new)
        if kv is not None and kv.num_dropped:
            return kv.num_dropped
        have = len(kv.table) if kv is not None else 0
        return max(0, self._num_blocks_for(request.num_computed_tokens + num_new) - have)

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _growth(self, request, num_blocks: int, num_new: int) -> int:
        """Blocks beyond a table of num_blocks for the request's next num_new tokens."""
        return max(0, self._num_blocks_for(request.num_computed_tokens + num_new) - num_blocks)

    # -- allocation --------------------------------------------------------
    def allocate_slots(self, request, num_new: int, prefix: CachedPrefix | None = None) -> list[int] | None:
        """Device blocks for the request's next `num_new` tokens (after its num_computed_tokens, or after
        a cached `prefix` from `find_cached_prefix`, whose blocks it then shares), or None with nothing
        taken when the pool has too few. A partly dropped request gets its dropped blocks back (the
        cached prefix of them shared, the rest fresh) in front of its kept tail. Returns the blocks added."""
        kv = self._get(request)
        if kv.swapped is not None:
            raise ValueError(f"request {request.request_id} is swapped out: swap_in first")
        need = self.blocks_needed(request, num_new, prefix)
        if need > self.pool.num_free:
            return None
        shared: list[int] = []
        if prefix is not None:
            if request.num_computed_tokens or (kv.table and not kv.num_dropped):
                raise ValueError(f"request {request.request_id} already has KV: a cached prefix cannot join it")
            need -= self._num_evictable(prefix)
            self.pool.touch(prefix.blocks)
            shared = list(prefix.blocks)
        new = self.pool.allocate(need) if need else []
        if kv.num_dropped:
            kv.table[:0] = shared + new
            kv.num_dropped = 0
        else:
            kv.table.extend(shared + new)
        kv.num_committed = max(kv.num_committed, len(shared))
        return new

    def free(self, request) -> None:
        """Give back everything the request holds: its table (last block first, so its prefix stays
        cached longest), parked blocks and host blocks. Its computed full blocks are offered to the
        prefix cache first."""
        kv = self._kv.pop(request.request_id, None)
        if kv is None:
            return
        if kv.table:
            self.prefix.commit(request, kv.table, kv.num_committed)
            self.pool.free(kv.table[::-1])
        if kv.swapped is not None:
            if kv.swapped.park_blocks:
                self.pool.free(kv.swapped.park_blocks)
            if kv.swapped.host_blocks:
                self.host.free(kv.swapped.host_blocks)

    # -- recompute: drop the oldest blocks, keep the tail -------------------
    def drop_oldest(self, request, n: int) -> int:
        """Give back the request's oldest n blocks (the tokens farthest from its next step) and keep
        the rest; `allocate_slots` re-allocates them in front when it resumes. Returns blocks freed."""
        kv = self._get(request)
        if not 0 < n < len(kv.table) or kv.num_dropped:
            raise ValueError(f"cannot drop {n} of {len(kv.table)} blocks of {request.request_id}")
        self.prefix.commit(request, kv.table, kv.num_committed)
        freed = self._release(kv.table[:n])
        del kv.table[:n]
        kv.num_dropped, kv.num_committed = n, 0
        return freed

    def _release(self, blocks: list[int]) -> int:
        """Drop one reference from each block (last first); returns how many nobody references now."""
        freed = sum(1 for b in blocks if self.pool.refcount(b) == 1)
        self.pool.free(blocks[::-1])
        return freed

    # -- swap and partial swap ----------------------------------------------
    def park_blocks_for(self, num_blocks: int, keep_layers: int) -> int:
        """Device blocks that hold `keep_layers` layers of num_blocks blocks once packed."""
        return num_park_blocks(self.num_layers, keep_layers, num_blocks)

    def can_swap_out(self, request) -> bool:
        return self.num_host_free >= self.num_table_blocks(request) > 0

    def swap_out(self, request, keep_layers: int = 0) -> tuple[KVMove, int]:
        """Move the request's KV off the device: layers [0, L - keep_layers) to host blocks, the last
        keep_layers packed into blocks of its own table (partial swap), its other references given
        back. Parking writes, so it uses only blocks this request alone references; with too few of
        those every layer goes to the host (the move's num_host_layers says which happened). Returns
        (the copy to execute, device blocks freed). The blocks freed here may be written by the same
        step's forward: the engine runs the move before it."""
        kv = self._get(request)
        n = len(kv.table)
        host = self.host.allocate(n) if n else None
        if host is None or n == 0:
            raise ValueError(f"no host space to swap out {n} blocks of {request.request_id}")
        self.prefix.commit(request, kv.table, kv.num_committed)
        c = self.park_blocks_for(n, keep_layers)
        park = [b for b in kv.table if self.pool.refcount(b) == 1][:c]
        if len(park) < c:
            keep_layers, park = 0, []
        for b in park:
            self.pool.uncache(b)
        move = KVMove(request.request_id, "out", list(kv.table), host, self.num_layers - keep_layers, park)
        parked = set(park)
        freed = self._release([b for b in kv.table if b not in parked])
        kv.swapped = SwappedKV(n, self.num_layers - keep_layers, host, park)
        kv.table, kv.num_committed = [], 0
        return move, freed

    def park(self, request, keep_layers: int) -> tuple[KVMove, int]:
        """Partial swap: `swap_out` keeping the last keep_layers layers parked on the device (every layer
        goes to the host when the request alone holds too few blocks to park them in: no park blocks)."""
        return self.swap_out(request, keep_layers)

    def swap_in(self, request, num_new: int) -> KVMove | None:
        """Bring a swapped request's KV back into fresh device blocks (its parked blocks become the first
        blocks of the new table and are unpacked in place), with room for its next num_new tokens.
        Returns the copy to execute, or None with nothing taken when the pool has too few blocks."""
        kv = self._get(request)
        s = kv.swapped
        if s is None:
            raise ValueError(f"request {request.request_id} is not swapped out")
        new = self.pool.allocate(s.num_blocks - len(s.park_blocks) + self._growth(request, s.num_blocks, num_new))
        if new is None:
            return None
        table = s.park_blocks + new
        move = KVMove(request.request_id, "in", table[:s.num_blocks], s.host_blocks, s.num_host_layers,
                      s.park_blocks)
        # Host blocks are free again now and reused at the earliest by a later move: moves run in order.
        self.host.free(s.host_blocks)
        kv.table, kv.swapped = table, None
        return move

    # -- prefix caching ----------------------------------------------------
    def find_cached_prefix(self, request) -> CachedPrefix | None:
        """The cached leading blocks a request could share as it is admitted: a request holding no KV
        (its known tokens but the last), or one resuming with its oldest blocks dropped (all but the
        last dropped block: the rebuild then computes at least that one, and ends on its kept tail).
        None when caching is off, the request holds other KV, or nothing is cached; and for a request
        still computing its prompt logprobs (a cached position has no logits to give them, so, as vLLM
        does, such a request computes its whole prompt; its blocks are still cached for others)."""
        kv = self._kv.get(request.request_id)
        if (request.num_computed_tokens or (kv is not None and kv.swapped is not None)
                or getattr(request, "wants_prompt_logits", False)):
            return None
        if kv is not None and kv.num_dropped:
            return self.prefix.find(request, max_blocks=kv.num_dropped - 1)
        if self.holds_kv(request):
            return None
        return self.prefix.find(request)

    def num_lookup_tokens(self, request) -> int:
        """Tokens `find_cached_prefix` looks up for the request now (a query, as the stats count it)."""
        kv = self._kv.get(request.request_id)
        if (request.num_computed_tokens or (kv is not None and kv.swapped is not None)
                or getattr(request, "wants_prompt_logits", False)):
            return 0
        if kv is not None and kv.num_dropped:
            return kv.num_dropped * self.block_size
        return 0 if self.holds_kv(request) else request.num_tokens

    def note_scheduled(self, request, start: int, num_new: int) -> None:
        """This step computes tokens [start, start + num_new) of the request: the blocks they fill are
        in flight, and a request that would share them waits a step instead of computing them again."""
        self.prefix.note_in_flight(request, start, num_new)

    def begin_step(self, running) -> None:
        """Before a step's decision: the last forward has run, so the running requests' newly computed
        full blocks go into the prefix cache."""
        self.prefix.begin_step()
        if not self.prefix.enabled:
            return
        for r in running:
            kv = self._kv.get(r.request_id)
            if kv is not None and kv.table:
                kv.num_committed = self.prefix.commit(r, kv.table, kv.num_committed)

    def forget(self, request) -> None:
        """The request is gone (finished or aborted): free what it holds and its block hashes."""
        self.free(request)
        self.prefix.forget(request)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block's hash: later requests find nothing until new blocks are committed.
        Returns the number of blocks forgotten."""
        return self.prefix.reset()

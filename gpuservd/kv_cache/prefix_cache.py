"""Automatic prefix caching: full KV blocks found again by their content.

Every full block's content has a hash chained from its parent block's hash,
seeded with the engine's identity (model or variant name, weights directory,
dtype), so different weights never share KV. A request's computed full blocks
are offered to the cache (`commit`) once the forward that wrote them has run;
a new request shares the longest cached run of its leading blocks (`find`) and
computes only the rest. Its last known token is never taken from the cache:
the step must compute it to get the logits of the next token, so a prompt
cached in full still computes its last block again (into a block of its own:
a shared block is never written).

The blocks themselves, their hashes and the least-recently-used eviction of
cached blocks nobody references are the BlockPool's; this module decides what
the hashes are and keeps the counts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import asdict, dataclass

from gpuservd.kv_cache.block_pool import BlockPool


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The content hash of one full block: its parent's hash and its token ids."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass
class CachedPrefix:
    """A prefix cache hit: a request's leading blocks found in the cache."""

    blocks: list[int]  # cached blocks holding the request's first len(blocks) * block_size tokens
    num_tokens: int  # tokens they hold
    deferred: bool = False  # its next block is being computed this step by another request: wait a step


@dataclass
class PrefixCacheStats:
    """Running totals in tokens, counted as vLLM does: an admitted request's known tokens are queried."""

    num_query_tokens: int = 0  # tokens of admitted requests looked up
    num_hit_tokens: int = 0  # of them, found cached (not computed)
    num_repeat_tokens: int = 0  # caching off: tokens a cache would have found (repeated prefixes)
    num_resets: int = 0  # times the cache was dropped

    def to_dict(self) -> dict:
        return asdict(self)


class PrefixCache:
    """The content hashes of requests' blocks, cache look-ups and what they found."""

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool, namespace: str = "",
                 seen_limit: int = 4096):
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self._root = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self._hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its first full blocks
        self._in_flight: set[bytes] = set()  # blocks this step's forward fills
        # Caching off: hashes of recently admitted requests' blocks, to count what a cache would reuse.
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._seen_limit = seen_limit
        self.stats = PrefixCacheStats()

    def hashes(self, request, num_blocks: int) -> list[bytes]:
        """Hashes of the request's first num_blocks full blocks (fewer if fewer tokens are known)."""
        hs = self._hashes.setdefault(request.request_id, [])
        want = min(num_blocks, request.num_tokens // self.block_size)
        bs = self.block_size
        while len(hs) < want:
            i = len(hs)
            hs.append(block_hash(hs[-1] if hs else self._root, request.token_slice(i * bs, bs)))
        return hs[:want]

    def forget(self, request) -> None:
        self._hashes.pop(request.request_id, None)

    def _max_hit_blocks(self, request) -> int:
        return (request.num_tokens - 1) // self.block_size

    def find(self, request, max_blocks: int | None = None) -> CachedPrefix | None:
        """The longest run of the request's leading full blocks in the cache (at most max_blocks), leaving
        its last token to compute; None when caching is off or nothing is cached."""
        if not self.enabled:
            return None
        blocks = []
        limit = self._max_hit_blocks(request)
        hs = self.hashes(request, limit if max_blocks is None else min(limit, max_blocks))
        for h in hs:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        deferred = len(blocks) < len(hs) and hs[len(blocks)] in self._in_flight
        if not blocks and not deferred:
            return None
        return CachedPrefix(blocks, len(blocks) * self.block_size, deferred)

    def count_admission(self, request, prefix: CachedPrefix | None, queried: int) -> tuple[int, int, int]:
        """Count an admitted request's look-up of `queried` tokens: (query tokens, hit tokens, repeat
        tokens). With caching off, the repeat tokens of a request that held no KV are those a cache would
        have found among recent admissions."""
        if self.enabled:
            hit = prefix.num_tokens if prefix is not None else 0
            self.stats.num_query_tokens += queried
            self.stats.num_hit_tokens += hit
            return queried, hit, 0
        if queried != request.num_tokens:
            return 0, 0, 0  # a rebuild of its own dropped blocks, not a repeated prompt
        hs = self.hashes(request, self._max_hit_blocks(request))
        self.forget(request)
        repeat = 0
        for h in hs:
            if h not in self._seen:
                break
            repeat += 1
        for h in hs:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self._seen_limit:
            self._seen.popitem(last=False)
        self.stats.num_repeat_tokens += repeat * self.block_size
        return 0, 0, repeat * self.block_size

    def note_in_flight(self, request, start: int, num_new: int) -> None:
        """Blocks that tokens [start, start + num_new) complete are being written this step."""
        if not self.enabled:
            return
        first, end = start // self.block_size, (start + num_new) // self.block_size
        if end > first:
            self._in_flight.update(self.hashes(request, end)[first:])

    def begin_step(self) -> None:
        """A new step: the last one's forward has run, its blocks are no longer in flight."""
        self._in_flight.clear()

    def commit(self, request, table: list[int], num_committed: int) -> int:
        """Offer the request's computed full blocks after the first num_committed of its table to the
        cache; returns how many leading blocks are committed now."""
        if not self.enabled:
            return num_committed
        n = min(request.num_computed_tokens // self.block_size, len(table))
        if n <= num_committed:
            return num_committed
        for b, h in zip(table[num_committed:n], self.hashes(request, n)[num_committed:]):
            self.pool.cache(b, h)  # False when another block holds that content already: ours stays private
        return n

    def reset(self) -> int:
        """Drop the whole cache (blocks in use stay with their requests); returns blocks forgotten."""
        self.stats.num_resets += 1
        self._in_flight.clear()
        return self.pool.reset_cache()

"""What the daemon asks of a running engine, as named module-level functions.

`EngineLoop.call(fn)` runs fn(engine) between steps. With `engine.isolation:
process` the engine lives in a worker process and `fn` crosses a pipe pickled,
so every caller passes one of these (bound with functools.partial), never a
lambda or closure: `loop.call(partial(set_kv_limit, 120))`. `EngineFacts` is
what the daemon keeps of an engine once it is built (the engine itself stays
on its thread or in its worker).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineFacts:
    """An engine's fixed facts, read once it is built (on its thread, or in its worker and sent back)."""

    max_model_len: int  # context length
    weights_bytes: int  # its weights on the device, in the compute dtype (a variant's: its delta)
    num_kv_blocks: int  # the KV pool
    bytes_per_block: int  # one KV block over every layer
    source_tier: str = ""  # where a worker read its weights: disk | disk-int8 ("" = the daemon chose)
    bytes_read: int = 0  # bytes a worker read from the store for them

    @classmethod
    def of(cls, engine, source_tier: str = "", bytes_read: int = 0) -> "EngineFacts":
        return cls(engine.max_model_len, engine.runner.weights.nbytes(), engine.pool.num_blocks,
                   engine.runner.cache.shape.bytes_per_block, source_tier, bytes_read)


def set_tenant_quotas(quotas, engine) -> None:
    """New tenant quotas (a reload)."""
    engine.set_tenant_quotas(quotas)


def set_kv_limit(blocks: int | None, engine) -> None:
    """Cap the KV pool at `blocks` (a memory quota); None lifts the cap."""
    engine.pool.set_limit(blocks)


def reset_prefix_cache(engine) -> int:
    """Drop the engine's prefix cache; returns the blocks forgotten."""
    return engine.reset_prefix_cache()


def request_views(engine) -> dict[str, dict]:
    """The engine's view of each unfinished request (GET /admin/requests)."""
    return {rid: {"state": r.state.name.lower(), "num_output_tokens": len(r.output_token_ids),
                  "num_preemptions": r.num_preemptions, "priority": r.priority}
            for rid, r in engine.requests.items()}

"""A real daemon squeezed so that it preempts, and a burst of requests to make it: shared by the console tests.

`SQUEEZED` gives the daemon a KV pool of a few dozen tokens; `burst()` sends
concurrent long completions so running sequences run out of blocks and the
scheduler preempts (recompute). The recording in this directory was made with
these (see record_stream.py).
"""

from __future__ import annotations

import threading

import httpx

# 3 layers x 2 (k, v) x 2 KV heads x 16 dims x 4 bytes = 768 bytes a token: 1024 tokens (256 blocks of 4),
# so six requests of 9 + 500 tokens cannot all stay resident, while any one of them fits.
SQUEEZED = {
    "engine": {"kv_cache_bytes": 768 * 1024, "block_size": 4},
    "scheduler": {"max_num_seqs": 8},
    "server": {"max_queued_per_model": 64},
}


def burst(socket_path, n: int = 6, max_tokens: int = 500, prompt: str = "the capital of france is",
          priority: int | None = None) -> list[threading.Thread]:
    """Start n streaming completions in threads (each reads its stream to the end), at `priority` when given
    (else the tenant's); returns the threads."""

    def one() -> None:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path)), base_url="http://gpuserv",
                          timeout=120) as c:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            if priority is not None:
                body["priority"] = priority
            try:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:  # cancelled or the daemon stopped: the test checks the daemon's side
                pass

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads

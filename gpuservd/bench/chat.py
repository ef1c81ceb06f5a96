"""Multi-turn chats over one shared system prompt, and the prefix-cache hit rate they should give.

A request class with `prefix_tokens: N` starts every prompt with the same N
random tokens (a system prompt); with `turns: T` its requests form
conversations of T turns, turn k resending the whole history: the system
prompt, every earlier turn's user message and reply, then its own message.
The class's `prompt_tokens` draws each user message's length and its
`output_tokens` each reply's; the history carries a reply as random tokens of
the length that turn asked for (the model's actual reply differs, so what a
later turn can reuse is the earlier turn's prompt). Requests are dealt to
conversations round-robin in arrival order (request j of the class is turn
j // C of conversation j % C), so a conversation's next turn arrives after
the other conversations' current turns.
"""

from __future__ import annotations

import math

import numpy as np


def build_chats(specs: list[dict], classes: dict, rng: np.random.Generator, random_prompt) -> None:
    """Fill `prompt_ids` of the specs whose class has a shared prefix or several turns (in place).
    random_prompt(rng, n) -> n token ids."""
    for name, c in classes.items():
        if not c.prefix_tokens and c.turns == 1:
            continue
        mine = [s for s in specs if s["cls"] == name]
        system = random_prompt(rng, c.prefix_tokens) if c.prefix_tokens else []
        num_convs = max(1, math.ceil(len(mine) / c.turns))
        history: list[list[int]] = [list(system) for _ in range(num_convs)]
        for j, s in enumerate(mine):
            conv = j % num_convs
            user = random_prompt(rng, int(s["prompt_tokens"]))
            s["prompt_ids"] = history[conv] + user
            history[conv] = s["prompt_ids"] + random_prompt(rng, int(s["output_tokens"]))


def expected_prefix_hits(prompts: list[list[int]], block_size: int) -> tuple[int, int]:
    """(hit tokens, query tokens) an unbounded prefix cache gives these prompts admitted in this order:
    each reuses the full blocks of its longest prefix an earlier prompt had, but never its last token."""
    seen: set[tuple[int, ...]] = set()
    hits = queries = 0
    for p in prompts:
        queries += len(p)
        usable = (len(p) - 1) // block_size
        n = 0
        while n < usable and tuple(p[:(n + 1) * block_size]) in seen:
            n += 1
        hits += n * block_size
        for k in range(1, len(p) // block_size + 1):
            seen.add(tuple(p[:k * block_size]))
    return hits, queries

"""Preemption settings, the planner's cost model and auto mode.

- `PreemptionMode`: `on` lets a waiting request displace a running one (higher
  priority, or at equal priority a much shorter remaining estimate); `off`
  behaves like vLLM's default (nothing is displaced; when KV runs out the newest
  running request is recomputed); `auto` switches between the two from the
  skew of recent output lengths (`AutoMode`).
- `Granularity`: `request` moves a running request only when memory runs out;
  `token` also lets the scheduler pause any request at any step boundary;
  `layer` also suspends a running forward between transformer layers when an
  urgent (higher-priority) request arrives mid-step.
- `MoveKind`: how a victim's KV leaves the device. `CostModel` keeps running
  measurements (host copy bandwidth, device copy bandwidth, prefill rate) and
  the planner picks the cheapest kind that frees what is needed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from gpuservd.config import Granularity, MoveKind, PreemptionMode
from gpuservd.engine.request import RequestState
from gpuservd.events.types import PreemptionModeSwitch


def _ewma(old: float | None, new: float, alpha: float = 0.3) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


@dataclass
class CostModel:
    """Run-time measurements the planner prices moves with (bytes/s and tokens/s; None = not yet seen)."""

    host_bandwidth: float | None = None  # device <-> host copy, bytes/s
    device_bandwidth: float | None = None  # device <-> device copy (parking), bytes/s
    prefill_rate: float | None = None  # prefill tokens/s of recent steps

    def observe_copy(self, bytes_moved: int, bytes_parked: int, seconds: float) -> None:
        """One executed move: a full swap measures the host link; a partial swap's time left after
        its host bytes (at the known host bandwidth) measures device-side parking."""
        if seconds <= 0:
            return
        if bytes_moved and not bytes_parked:
            self.host_bandwidth = _ewma(self.host_bandwidth, bytes_moved / seconds)
        elif bytes_parked:
            host_s = bytes_moved / self.host_bandwidth if (bytes_moved and self.host_bandwidth) else 0.0
            if seconds - host_s > 0:
                self.device_bandwidth = _ewma(self.device_bandwidth, bytes_parked / (seconds - host_s))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 16 and seconds > 0:
            self.prefill_rate = _ewma(self.prefill_rate, tokens / seconds)

    def swap_cost_s(self, nbytes_host: int, nbytes_park: int) -> float | None:
        """Out and back in."""
        if self.host_bandwidth is None:
            return None
        dev_bw = self.device_bandwidth or self.host_bandwidth
        return 2 * nbytes_host / self.host_bandwidth + nbytes_park / dev_bw

    def recompute_cost_s(self, tokens: int) -> float | None:
        return None if self.prefill_rate is None else tokens / self.prefill_rate

    def to_dict(self) -> dict:
        return {"host_bandwidth": self.host_bandwidth, "device_bandwidth": self.device_bandwidth,
                "prefill_rate": self.prefill_rate}


def plan_kind(forced: MoveKind, cost: CostModel, *, host_free: int, n_blocks: int, need: int,
              bytes_per_block: int, keep_layers: int, num_layers: int, block_size: int,
              n_parked: int) -> MoveKind:
    """The kind of move for a victim holding n_blocks when `need` blocks must be freed; a partial
    swap keeping keep_layers would leave n_parked of them on the device (the KV cache manager says).

    Swap needs n_blocks free host blocks; otherwise the victim is recomputed. Under `auto`
    the cheapest of the kinds that free at least `need` blocks wins; before any measurement
    exists, swap (a copy costs no model math) is assumed cheaper.
    """
    if forced is not MoveKind.AUTO:
        if forced in (MoveKind.SWAP, MoveKind.PARTIAL_SWAP) and host_free < n_blocks:
            return MoveKind.RECOMPUTE
        if forced is MoveKind.PARTIAL_SWAP and keep_layers == 0:
            return MoveKind.SWAP
        return forced
    options: dict[MoveKind, float | None] = {}
    drop = min(n_blocks, need)
    options[MoveKind.RECOMPUTE] = cost.recompute_cost_s(drop * block_size)
    if host_free >= n_blocks:
        options[MoveKind.SWAP] = cost.swap_cost_s(n_blocks * bytes_per_block, 0)
        if keep_layers and n_blocks - n_parked >= min(need, n_blocks):
            layer_bytes = bytes_per_block // num_layers
            options[MoveKind.PARTIAL_SWAP] = cost.swap_cost_s(
                n_blocks * (num_layers - keep_layers) * layer_bytes, 2 * n_blocks * keep_layers * layer_bytes)
    known = {k: v for k, v in options.items() if v is not None}
    if not known:
        return MoveKind.SWAP if MoveKind.SWAP in options else MoveKind.RECOMPUTE
    if MoveKind.SWAP in options and options[MoveKind.SWAP] is None:
        return MoveKind.SWAP
    return min(known, key=known.get)


def percentile(sorted_values: list[int], q: float) -> float:
    """Nearest-rank percentile of an ascending list: the value at rank ceil(q/100 * n). (Not round(q n
    + 0.5): Python rounds half to even, which picks the rank above at some sizes: P50 of [1, 2] would read 2.)"""
    idx = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values) / 100 - 1e-9) - 1))
    return float(sorted_values[idx])


def km_quantile(finished: list[int], running: list[int], q: float) -> tuple[float | None, bool]:
    """The q-quantile of output lengths by Kaplan-Meier: `finished` are lengths, `running` are lower bounds
    (requests still generating: their length is at least that). Returns (value, known). known is False
    when the estimate never falls to 1 - q among the samples (the rest are still running); value is then
    the largest sample, a lower bound. Without running samples this is the nearest-rank percentile."""
    samples = sorted([(t, 0) for t in finished] + [(t, 1) for t in running])  # events before censored at a tie
    n, i, surv = len(samples), 0, 1.0
    while i < n:
        t = samples[i][0]
        j = i
        while j < n and samples[j][0] == t:
            j += 1
        deaths = sum(1 for k in range(i, j) if samples[k][1] == 0)
        if deaths:
            surv *= 1.0 - deaths / (n - i)
            if surv <= 1.0 - q + 1e-12:
                return float(t), True
        i = j
    return (float(samples[-1][0]) if samples else None), False


class AutoMode:
    """Preemption on while P99/P50 of recent output lengths exceeds `ratio` (preemption pays only when lengths are skewed).

    Lengths are counted as they are known: the finished requests' (a window of `window`), and, as lower
    bounds, those of the requests still generating (Kaplan-Meier, `km_quantile`). Finished lengths alone
    are biased short while a workload warms up (short requests finish first, long ones are still
    running), which kept auto off until the first long requests had finished; the KV-bound bench's
    default trailed `on` by that much. A running request already longer than `ratio` times the median
    is evidence enough; a median not yet known (most requests still running) decides nothing."""

    def __init__(self, window: int, ratio: float, min_samples: int):
        self.lengths: deque[int] = deque(maxlen=window)
        self.ratio = ratio
        self.min_samples = min_samples
        self.enabled = False

    def observe(self, output_len: int, running: list[int] = ()) -> PreemptionModeSwitch | None:
        """Record a finished request's output length, with the lengths so far of the requests still
        generating; returns a switch event (with its evidence) or None."""
        self.lengths.append(max(1, output_len))
        if len(self.lengths) < self.min_samples:
            return None
        running = [n for n in running if n >= 1]
        finished = list(self.lengths)
        p50, p50_known = km_quantile(finished, running, 0.50)
        if not p50_known:
            return None
        p99, p99_known = km_quantile(finished, running, 0.99)
        skew = p99 / p50
        if skew > self.ratio:
            want = True  # p99 exact or a lower bound: the tail is at least this long
        elif p99_known:
            want = False
        else:
            return None  # the tail is still running and not yet long enough to tell
        if want == self.enabled:
            return None
        self.enabled = want
        return PreemptionModeSwitch(enabled=want, p50=p50, p99=p99, ratio=round(skew, 3), threshold=self.ratio,
                                    window=len(self.lengths), running=len(running), p99_lower_bound=not p99_known)


def status(scheduler, settings, host_pool, num_suspended: int) -> dict:
    """The preemption settings in force and the state of the host pool (the engine's preemption_status)."""
    sc, p = scheduler, settings
    return {"mode": p.mode, "enabled": sc.preemption_on, "granularity": p.granularity, "kind": p.kind,
            "victim_policy": p.victim_policy, "memory_threshold": p.memory_threshold,
            "host_blocks_used": host_pool.num_used, "host_blocks_total": host_pool.num_blocks,
            "num_swapped": sum(r.state is RequestState.SWAPPED for r in sc.waiting),
            "num_suspended": num_suspended,
            # Requests preempted max_preemptions times (never chosen again) and the free blocks kept
            # for their growth: why requests may wait while kv_blocks_free is not 0.
            "num_pinned": sum(sc.is_pinned(r) for r in sc.running + sc.waiting),
            "kv_blocks_reserved": sc.reserved_blocks(),
            "costs": sc.cost.to_dict()}

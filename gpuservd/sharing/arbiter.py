"""The arbiter: who may run on a shared device, and when: time slices, bandwidth
priority, and latency-critical models first (isolation is judged on P99, never the mean).

Every model's engine thread asks before each step (`begin_step`), offers to give
way between layers (`between_layers`) and says when it has nothing left to do
(`idle`). Models in one SM group take turns; groups run side by side.

Time slices. A group is held by one model at a time for a quantum
(`quantum_ms`, default 20). When the quantum is over and another model of the
group waits, the holder gives way at its next layer boundary or step, and the
next holder is picked by weighted fairness: the smallest virtual time, where a
model's virtual time advances by its run time divided by its share. A holder
alone in its group keeps the group without switching.

Priority. A latency-critical model that has used no more than its share over the last ~5 s (an exponentially
decayed average) goes first: it is picked before best-effort models and it cuts a best-effort holder's quantum
short at the holder's next layer boundary, so it waits at most one layer of the other model, not a whole step.
Above its share it takes turns like everyone else, so a best-effort model is never starved below its share.

Bandwidth priority. Memory bandwidth is shared even between partitions
(and between a CPU's cores). Every `throttle.interval_ms` the controller looks
at the latency-critical models' decode steps (steps carrying prefill are long
by nature and left out): their running time, the waits for the grant taken
out, against their targets (`step_target_ms`, or 1.5x the median of its decode
steps that ran while no other model ran). Waiting for a turn is the time
slices' business (bounded by half a layer); a step that *runs* slower than it
does alone is slowed by a neighbour running at the same time: that is
bandwidth. On Hopper+ the device's own DRAM bandwidth use (NVML GPM) above
`throttle.mem_bw_threshold_pct` is pressure too. Under pressure each
best-effort model's duty cycle is multiplied by `throttle.decrease`; calm:
raised by `throttle.increase` (AIMD, as TCP does). A best-effort model at duty d leaves the device idle for
(1 - d) / d of its last step's time before its next step. A latency-critical
model with no target yet (no step of it ran alone: a neighbour always runs)
counts as pressure until it has one: the neighbours are held back so it can.

Switching cost. Each handoff is timed from the release to the moment the next holder's thread runs
(`switch_s` in the `time_slice` event, one per handoff; a model alone that goes idle switches nothing and
emits none); the share of contended time spent switching is `overhead_share` in `status()` and feeds the
`timeslice_overhead` hint.

The arbiter holds one lock; the per-layer check takes it only when another model of the group is waiting,
and a model alone in its group makes none (its engine asks `alone()` each step).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from gpuservd.events.types import BandwidthThrottle, Event, TimeSlice
from gpuservd.sharing.clock import WallClock
from gpuservd.sharing.config import SharingClass, SharingConfig

USAGE_TAU_S = 5.0  # time constant of the usage average that decides "within its share"
SHARE_TOLERANCE = 0.02  # a latency-critical model up to this much over its share still goes first
TARGET_FACTOR = 1.5  # default step target = this x the model's median step time when alone
SOLO_WINDOW = 64  # steps kept to learn that median
MAX_THROTTLE_SLEEP_S = 0.5  # a throttled best-effort model never pauses longer than this at once
VTIME_BOUND_QUANTA = 2  # a model joining the queue is at most this many quanta ahead of or behind the others


@dataclass
class ModelShare:
    """One model's standing with the arbiter (read under the arbiter's lock)."""

    name: str
    group: str
    share: float
    sharing_class: SharingClass
    step_target_s: float = 0.0  # 0 = learned
    domain: str = ""  # its memory bus (bandwidth_domain): pressure crosses no domain boundary
    duty: float = 1.0  # bandwidth priority: the share of time a best-effort model may issue steps
    vtime: float = 0.0  # run seconds / share
    usage: float = 0.0  # decayed fraction of recent time holding the group
    usage_t: float = 0.0
    closed: bool = False
    # accounting
    num_slices: int = 0
    num_cut_short: int = 0  # slices ended early for a latency-critical model
    num_throttle_waits: int = 0
    throttle_wait_s: float = 0.0
    run_s: float = 0.0
    wait_s: float = 0.0  # waiting for the grant
    num_steps: int = 0
    # step timing (engine thread)
    t_want: float = 0.0  # when the current step asked to run
    waited_s: float = 0.0  # grant waits within the current step
    overlapped: bool = False  # another model ran at some point during the current step
    last_step_end: float = 0.0
    last_step_s: float = 0.0
    solo_steps: deque = field(default_factory=lambda: deque(maxlen=SOLO_WINDOW))
    interval_steps: list = field(default_factory=list)  # decode steps' running times since the controller looked
    recent_latency: deque = field(default_factory=lambda: deque(maxlen=256))  # decode steps' latency, waits included

    @property
    def latency_critical(self) -> bool:
        return self.sharing_class is SharingClass.LATENCY_CRITICAL

    def target_s(self) -> float | None:
        if self.step_target_s:
            return self.step_target_s
        if len(self.solo_steps) < 8:
            return None
        return TARGET_FACTOR * sorted(self.solo_steps)[len(self.solo_steps) // 2]


@dataclass
class _Group:
    name: str
    holder: ModelShare | None = None
    granted_at: float = 0.0  # when the holder's current slice started running
    waiting: dict = field(default_factory=dict)  # name -> (ModelShare, since)
    released_at: float = 0.0  # when the previous holder let go (a handoff in progress)
    released_by: str = ""
    release_reason: str = ""
    release_run_s: float = 0.0


class Arbiter:
    """Time slices and priorities for the models of one device."""

    def __init__(self, config: SharingConfig, device: str = "cpu", clock: WallClock | None = None):
        self.config = config
        self.device = device
        self._time = clock or WallClock()  # sleeps and waits go through it too (a test hands in virtual time)
        self.clock = self._time.now
        self.quantum_s = config.quantum_ms / 1000
        self._cond = threading.Condition()
        self._models: dict[str, ModelShare] = {}
        self._groups: dict[str, _Group] = {}
        self._events: deque = deque(maxlen=4096)  # taken by the engine loops and published
        self._last_govern = self.clock()
        self.switch_s = 0.0
        self.num_switches = 0
        self.handoff_run_s = 0.0  # the run time of slices that ended in a handoff (the group was contended)
        self.num_throttle_changes = 0
        self._mem_bw: tuple[float, float] | None = None  # (monotonic time, device memory-bandwidth use %)

    # ---- membership -------------------------------------------------------------------------------
    def register(self, name: str, group: str, share: float, sharing_class: SharingClass,
                 step_target_ms: float = 0.0, bandwidth_domain: str = "") -> "ArbiterHandle":
        """bandwidth_domain: models that share a memory bus (one GPU; all CPU slots); a latency-critical model's
        pressure throttles best-effort models of its own domain only."""
        with self._cond:
            if name in self._models:
                raise ValueError(f"model {name} is already registered with the arbiter")
            self._groups.setdefault(group, _Group(group))
            others = [m.vtime for m in self._models.values() if m.group == group]
            m = ModelShare(name, group, max(share, 1e-3), sharing_class, step_target_ms / 1000,
                           vtime=min(others) if others else 0.0, usage_t=self.clock(), domain=bandwidth_domain)
            self._models[name] = m
        return ArbiterHandle(self, m)

    def unregister(self, name: str) -> None:
        with self._cond:
            m = self._models.pop(name, None)
            if m is None:
                return
            m.closed = True
            g = self._groups[m.group]
            g.waiting.pop(name, None)
            if g.holder is m:
                self._release(g, m, "unload")
            if not any(x.group == g.name for x in self._models.values()):
                self._groups.pop(g.name, None)
            self._time.notify_all(self._cond)

    def reconfigure(self, config: SharingConfig, shares: dict[str, float]) -> None:
        """New shares, classes, targets and quantum (a config reload); groups stay as they are."""
        with self._cond:
            self.config = config
            self.quantum_s = config.quantum_ms / 1000
            for name, m in self._models.items():
                spec = config.model(name)
                m.share = max(shares.get(name, m.share), 1e-3)
                m.sharing_class = spec.sharing_class
                m.step_target_s = spec.step_target_ms / 1000
                if m.latency_critical or not config.bandwidth_priority:
                    m.duty = 1.0
            self._time.notify_all(self._cond)

    # ---- the engine threads -----------------------------------------------------------------------
    def _begin_step(self, m: ModelShare) -> None:
        self._throttle(m)
        now = self.clock()
        with self._cond:
            m.t_want, m.waited_s, m.overlapped = now, 0.0, False
            g = self._groups.get(m.group)
            if g is None or m.closed:
                return
            if g.holder is m:
                self._mark_overlap(m)
                if self._should_yield(g, m, now):
                    self._release(g, m, "quantum")
                    self._wait_for_grant(g, m)
                return
            if g.holder is None and not g.waiting:
                self._grant(g, m, now)
                return
            self._wait_for_grant(g, m)

    def _between_layers(self, m: ModelShare) -> None:
        g = self._groups.get(m.group)
        if g is None or not g.waiting or g.holder is not m:  # nobody waits: no lock, no cost
            return
        with self._cond:
            now = self.clock()
            if g.holder is m and self._should_yield(g, m, now):
                best = self._pick(g, include=None)
                cut = best is not None and self._preferred(best) and not self._preferred(m) \
                    and now - g.granted_at < self.quantum_s
                self._release(g, m, "preempted" if cut else "quantum")
                if cut:
                    m.num_cut_short += 1
                self._wait_for_grant(g, m)

    def _end_step(self, m: ModelShare, decode_only: bool = True) -> None:
        """decode_only: the step carried no prefill. Only such steps feed the bandwidth signal: a prefill
        step is long by nature, and what a stream waits between two tokens is a decode step."""
        now = self.clock()
        with self._cond:
            latency = now - m.t_want
            m.num_steps += 1
            m.last_step_end = now
            m.last_step_s = latency - m.waited_s
            if decode_only:
                m.recent_latency.append(latency)
                m.interval_steps.append(m.last_step_s)
                if not m.overlapped and not self._others_running(m):
                    m.solo_steps.append(m.last_step_s)
            if now - self._last_govern >= self.config.throttle.interval_ms / 1000:
                self._govern(now)

    def _idle(self, m: ModelShare) -> None:
        with self._cond:
            g = self._groups.get(m.group)
            if g is not None and g.holder is m:
                self._release(g, m, "idle")

    # ---- decisions (lock held) --------------------------------------------------------------------
    def _others_running(self, m: ModelShare) -> bool:
        return any(g.holder is not None and g.holder is not m for g in self._groups.values())

    def _decay(self, m: ModelShare, now: float) -> float:
        m.usage *= math.exp(-(now - m.usage_t) / USAGE_TAU_S)
        m.usage_t = now
        return m.usage

    def _usage(self, m: ModelShare, now: float) -> float:
        """Decayed share of recent time this model held its group, its current slice included."""
        g = self._groups.get(m.group)
        running = (now - g.granted_at) / USAGE_TAU_S if g is not None and g.holder is m else 0.0
        return self._decay(m, now) + running

    def _preferred(self, m: ModelShare) -> bool:
        """Latency-critical and within its share: goes first and may cut a best-effort slice short."""
        return m.latency_critical and self._usage(m, self.clock()) <= m.share + SHARE_TOLERANCE

    def _pick(self, g: _Group, include: ModelShare | None) -> ModelShare | None:
        """The next holder among the waiting models (and `include`, the holder asking whether to go on)."""
        cands = [w for w, _ in g.waiting.values()]
        if include is not None:
            cands.append(include)
        if not cands:
            return None
        preferred = [w for w in cands if self._preferred(w)]
        if preferred:  # the one that has waited longest (the holder counts as not waiting)
            return min(preferred, key=lambda w: g.waiting[w.name][1] if w.name in g.waiting else math.inf)
        now = self.clock()

        def vtime(w: ModelShare) -> float:  # the holder's slice so far counts
            return w.vtime + ((now - g.granted_at) / w.share if w is g.holder else 0.0)

        return min(cands, key=lambda w: (vtime(w), w is not g.holder, w.name))

    def _should_yield(self, g: _Group, m: ModelShare, now: float) -> bool:
        if not g.waiting:
            return False
        best = self._pick(g, include=m)
        if best is m:
            return False
        if now - g.granted_at >= self.quantum_s:
            return True
        return self._preferred(best) and not self._preferred(m)

    def _grant(self, g: _Group, m: ModelShare, now: float) -> None:
        g.holder = m
        g.granted_at = now
        self._mark_overlap(m)

    def _mark_overlap(self, m: ModelShare) -> None:
        """m runs now: it and every other group's holder share the device's bandwidth during their steps."""
        for g in self._groups.values():
            if g.holder is not None and g.holder is not m:
                g.holder.overlapped = True
                m.overlapped = True

    def _release(self, g: _Group, m: ModelShare, reason: str) -> None:
        now = self.clock()
        run = max(0.0, now - g.granted_at)
        m.run_s += run
        m.num_slices += 1
        m.vtime += run / m.share
        self._decay(m, now)
        m.usage += run / USAGE_TAU_S
        nxt = self._pick(g, include=None)
        if nxt is None:  # nobody waits: no switch, no time_slice event (a model alone is not time-sliced)
            g.holder = None
            return
        self.handoff_run_s += run
        # Hand over directly: the next holder is chosen now; its thread times the switch when it wakes.
        del g.waiting[nxt.name]
        g.holder = nxt
        g.granted_at = now
        g.released_at, g.released_by, g.release_reason, g.release_run_s = now, m.name, reason, run
        self._time.notify_all(self._cond)

    def _wait_for_grant(self, g: _Group, m: ModelShare) -> None:
        t0 = self.clock()
        if m.name not in g.waiting:
            others = [x.vtime for x in self._models.values() if x.group == g.name and x is not m]
            if others:  # credit from an idle spell, or debt from running first, of two quanta at most
                bound = VTIME_BOUND_QUANTA * self.quantum_s / m.share
                m.vtime = min(max(m.vtime, min(others) - bound), min(others) + bound)
            g.waiting[m.name] = (m, t0)
        while g.holder is not m and not m.closed:
            if g.holder is None and self._pick(g, include=None) is m:  # nobody to hand over (not expected)
                del g.waiting[m.name]
                g.holder, g.released_by = m, ""
                break
            self._time.wait(self._cond, 0.5)
        now = self.clock()
        waited = now - t0
        m.wait_s += waited
        m.waited_s += waited
        if g.holder is m:
            switch = now - g.released_at if g.released_at else 0.0
            if g.released_by:
                self.switch_s += switch
                self.num_switches += 1
                self._event({"model": g.released_by, "group": g.name, "run_s": g.release_run_s,
                             "switch_s": switch, "reason": g.release_reason, "next": m.name})
                g.released_by = ""
            g.granted_at = now  # the slice runs from now; the switch is overhead, not run time
            self._mark_overlap(m)

    def _throttle(self, m: ModelShare) -> None:
        """Bandwidth priority: a best-effort model below full duty leaves the device idle between its steps."""
        if m.latency_critical or m.duty >= 1.0 or not self.config.bandwidth_priority or not m.last_step_s:
            return
        gap = m.last_step_s * (1 - m.duty) / m.duty - (self.clock() - m.last_step_end)
        if gap <= 0:
            return
        g = self._groups.get(m.group)
        if g is not None and g.holder is m:  # do not sit on the group while pausing
            with self._cond:
                if g.holder is m:
                    self._release(g, m, "throttled")
        gap = min(gap, MAX_THROTTLE_SLEEP_S)
        m.num_throttle_waits += 1
        m.throttle_wait_s += gap
        self._time.sleep(gap)

    def _govern(self, now: float) -> None:
        """Bandwidth priority: AIMD on best-effort duty cycles from latency-critical step times over the last interval, per
        bandwidth domain (a GPU's HBM; the host's memory bus for CPU slots)."""
        self._last_govern = now
        t = self.config.throttle
        pressure: dict[str, dict] = {}  # domain -> why
        for m in self._models.values():
            steps, m.interval_steps = m.interval_steps, []
            if not m.latency_critical or not steps:
                continue
            target = m.target_s()
            p90 = sorted(steps)[min(len(steps) - 1, int(0.9 * len(steps)))]
            current = pressure.get(m.domain)
            if target is None:
                # No step of it has run alone yet (a best-effort neighbour is always running): hold the
                # neighbours back until it has, or it would never learn what its steps should take.
                if current is None and any(not x.latency_critical and x.domain == m.domain
                                           for x in self._models.values()):
                    pressure[m.domain] = {"latency_critical": m.name, "step_ms_p90": round(1000 * p90, 3),
                                          "target_ms": None, "reason": "calibrating"}
                continue
            if p90 > target and (current is None or current.get("reason") == "calibrating"):
                pressure[m.domain] = {"latency_critical": m.name, "step_ms_p90": round(1000 * p90, 3),
                                      "target_ms": round(1000 * target, 3), "reason": "over target"}
        bw = self._mem_bw
        if bw is not None and now - bw[0] < 3.0 and bw[1] > t.mem_bw_threshold_pct:
            lc = next((m for m in self._models.values() if m.latency_critical and m.domain not in pressure), None)
            if lc is not None:  # the reading is this arbiter's device's
                pressure[lc.domain] = {"latency_critical": lc.name, "mem_bw_util_pct": round(bw[1], 1),
                                       "threshold_pct": t.mem_bw_threshold_pct, "reason": "memory bandwidth"}
        if not self.config.bandwidth_priority:
            return
        for m in self._models.values():
            if m.latency_critical:
                continue
            why = pressure.get(m.domain)
            before = m.duty
            if why is not None:
                m.duty = max(t.min_duty, m.duty * t.decrease)
            else:
                m.duty = min(1.0, m.duty + t.increase)
            if m.duty != before and (why is not None or m.duty == 1.0):
                self.num_throttle_changes += 1
                self._events.append(BandwidthThrottle(model=m.name, duty=round(m.duty, 4), previous=round(before, 4),
                                                      device=self.device, **(why or {"reason": "calm"})))

    def _event(self, fields: dict) -> None:
        self._events.append(TimeSlice(device=self.device, quantum_ms=self.config.quantum_ms, **fields))

    def observe_readings(self, readings: dict | None) -> None:
        """The device's memory-bandwidth use (NVML GPM on Hopper+; None elsewhere), for the bandwidth-priority controller."""
        value = (readings or {}).get("mem_bw_util_pct")
        if value is not None:
            self._mem_bw = (self.clock(), float(value))

    # ---- reading ----------------------------------------------------------------------------------
    def take_events(self) -> list[Event]:
        out = []
        while True:
            try:
                out.append(self._events.popleft())
            except IndexError:
                return out

    def status(self) -> dict:
        with self._cond:
            now = self.clock()
            total = self.handoff_run_s + self.switch_s  # switching against contended time, not idle time
            groups = []
            for g in self._groups.values():
                groups.append({"name": g.name, "models": sorted(m.name for m in self._models.values()
                                                                if m.group == g.name),
                               "holder": g.holder.name if g.holder else None, "waiting": sorted(g.waiting)})
            models = {}
            for m in self._models.values():
                lat = sorted(m.recent_latency)
                target = m.target_s()
                models[m.name] = {
                    "group": m.group, "class": m.sharing_class.value, "share": round(m.share, 4),
                    **self._counters(m, now), "num_cut_short": m.num_cut_short, "num_steps": m.num_steps,
                    "num_throttle_waits": m.num_throttle_waits, "throttle_wait_s": round(m.throttle_wait_s, 4),
                    "decode_step_ms_p50": round(1000 * lat[len(lat) // 2], 3) if lat else None,
                    "decode_step_ms_p99": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
                    "step_target_ms": round(1000 * target, 3) if target else None,
                }
            return {"enabled": True, "quantum_ms": self.config.quantum_ms, "device": self.device,
                    "bandwidth_priority": self.config.bandwidth_priority, "groups": groups, "models": models,
                    "num_switches": self.num_switches, "switch_s": round(self.switch_s, 6),
                    "overhead_share": round(self.switch_s / total, 6) if total > 0 else 0.0,
                    "num_throttle_changes": self.num_throttle_changes}

    def _counters(self, m, now: float) -> dict:
        """One model's time-slice counters, as status() and counters() give them (under the lock)."""
        return {"usage": round(self._usage(m, now), 4), "duty": round(m.duty, 4), "num_slices": m.num_slices,
                "run_s": round(m.run_s, 4), "wait_s": round(m.wait_s, 4)}

    def counters(self) -> dict:
        """What /metrics reads of status(), without the latency percentiles (a sort per model under the lock
        the engine threads take around every step)."""
        with self._cond:
            now = self.clock()
            models = {m.name: self._counters(m, now) for m in self._models.values()}
            return {"enabled": True, "models": models, "switch_s": round(self.switch_s, 6)}


class ArbiterHandle:
    """What one model's engine thread holds: the calls it makes around its steps."""

    def __init__(self, arbiter: Arbiter, share: ModelShare):
        self.arbiter = arbiter
        self.share = share

    def begin_step(self) -> None:
        self.arbiter._begin_step(self.share)

    def between_layers(self, layer: int) -> None:
        self.arbiter._between_layers(self.share)

    def alone(self) -> bool:
        """No other model in this one's group: nobody to yield to (asked each step; a newcomer waits for it)."""
        m = self.share
        return not any(x is not m and x.group == m.group for x in list(self.arbiter._models.values()))

    def end_step(self, decode_only: bool = True) -> None:
        self.arbiter._end_step(self.share, decode_only)

    def idle(self) -> None:
        self.arbiter._idle(self.share)

    def take_events(self) -> list[Event]:
        return self.arbiter.take_events()

    def close(self) -> None:
        self.arbiter.unregister(self.share.name)

"""The sharing arbiter (time slices, bandwidth priority, latency-critical first) with model threads
whose "layers" are sleeps, on virtual time.

The arbiter reads, sleeps and waits through its clock; here that is a VirtualClock (tests/virtual_clock.py):
time stands still while any model thread runs and jumps to the next wake-up when all wait. A 2 ms layer takes
exactly 2 ms and a handoff none, however late a loaded machine wakes a thread, so the bounds below are the
arbiter's own (a quantum plus one layer, one layer of the other model, the shares), not allowances for the box.
"""

from __future__ import annotations

import threading

import pytest

from gpuservd.sharing.arbiter import Arbiter
from gpuservd.sharing.config import SharingClass, SharingConfig, ThrottleConfig
from virtual_clock import VirtualClock

BE, LC = SharingClass.BEST_EFFORT, SharingClass.LATENCY_CRITICAL
EPS = 1e-9


class Worker(threading.Thread):
    """A model's engine thread: steps of `layers` sleeps of `layer_s`, through the arbiter."""

    def __init__(self, handle, layers: int, layer_s: float, until: float, gap_s: float = 0.0, steps: int = 0):
        super().__init__(daemon=True)
        self.h, self.layers, self.layer_s, self.until, self.gap_s, self.max_steps = handle, layers, layer_s, until, gap_s, steps
        self.clock = handle.arbiter._time
        self.latencies: list[float] = []
        self.run_s = 0.0
        self.clock.expect()  # time cannot run ahead of a thread that has not begun

    def run(self):
        clock = self.clock
        clock.join(expected=True)
        try:
            while clock.now() < self.until and (not self.max_steps or len(self.latencies) < self.max_steps):
                t0 = clock.now()
                self.h.begin_step()
                for i in range(self.layers):
                    a = clock.now()
                    clock.sleep(self.layer_s)
                    self.run_s += clock.now() - a
                    self.h.between_layers(i)
                self.h.end_step()
                self.latencies.append(clock.now() - t0)
                if self.gap_s:
                    self.h.idle()
                    clock.sleep(self.gap_s)
            self.h.idle()
        finally:
            clock.leave()


def cfg(**kw) -> SharingConfig:
    c = SharingConfig(**kw)
    c.validate()
    return c


def arbiter(**kw) -> Arbiter:
    return Arbiter(cfg(**kw), clock=VirtualClock())


def run_all(workers):
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert not w.is_alive()


def test_two_best_effort_models_take_turns_by_share():
    arb = arbiter(quantum_ms=20, bandwidth_priority=False)
    a = arb.register("a", "dev", 0.75, BE)
    b = arb.register("b", "dev", 0.25, BE)
    until = arb.clock() + 2.0
    wa, wb = Worker(a, 4, 0.002, until), Worker(b, 4, 0.002, until)
    run_all([wa, wb])
    st = arb.status()
    ra, rb = st["models"]["a"]["run_s"], st["models"]["b"]["run_s"]
    assert ra / rb == pytest.approx(3.0, rel=0.05), (ra, rb)  # weighted 3:1
    # never both at once: the group is exclusive, so their run times add up to at most the time that passed
    assert wa.run_s + wb.run_s <= arb.clock() + EPS
    assert ra + rb == pytest.approx(arb.clock(), abs=0.01)  # and one of them always ran
    slices = [e for e in arb.take_events() if e["type"] == "time_slice"]
    assert len(slices) >= 20
    handoffs = [e for e in slices if e["next"]]
    assert handoffs and all(e["switch_s"] == 0.0 for e in handoffs)  # virtual time: a handoff costs none
    assert {e["reason"] for e in handoffs} <= {"quantum", "idle"}
    quantum = [e for e in handoffs if e["reason"] == "quantum"]
    # a slice ends at the first layer boundary past the quantum, never before it; the 1/4-share model's
    # virtual time runs ahead at once, so its slices are one quantum plus at most one 2 ms layer
    assert quantum and all(e["run_s"] >= 0.020 - EPS for e in quantum)
    assert all(e["run_s"] <= 0.022 + EPS for e in quantum if e["model"] == "b")
    assert st["num_switches"] == len(handoffs)
    assert st["overhead_share"] == 0.0


def test_a_model_alone_never_switches():
    arb = arbiter()
    a = arb.register("a", "dev", 0.5, BE)
    w = Worker(a, 3, 0.001, arb.clock() + 0.3)
    run_all([w])
    assert arb.status()["num_switches"] == 0


def test_latency_critical_cuts_a_best_effort_slice_at_the_next_layer():
    arb = arbiter(quantum_ms=50, bandwidth_priority=False)
    big = arb.register("big", "dev", 0.5, BE)
    small = arb.register("small", "dev", 0.5, LC)
    until = arb.clock() + 2.0
    wbig = Worker(big, 10, 0.005, until)  # 50 ms steps of 5 ms layers
    wsmall = Worker(small, 2, 0.002, until, gap_s=0.02)  # 4 ms steps, mostly idle
    run_all([wbig, wsmall])
    lat = wsmall.latencies
    # without the cut it would wait for the rest of a 50 ms quantum; with it, one 5 ms layer at most
    assert len(lat) > 20 and max(lat) <= 0.004 + 0.005 + EPS, lat
    st = arb.status()["models"]
    assert st["big"]["num_cut_short"] >= 0.9 * len(lat)  # nearly every small step found big running
    assert st["small"]["usage"] < 0.5


def test_latency_critical_over_its_share_takes_turns():
    """A latency-critical model that wants the whole device gets about its share, not all of it."""
    arb = arbiter(quantum_ms=20, bandwidth_priority=False)
    big = arb.register("big", "dev", 0.9, BE)
    small = arb.register("small", "dev", 0.1, LC)
    until = arb.clock() + 3.0
    wbig, wsmall = Worker(big, 4, 0.003, until), Worker(small, 4, 0.003, until)
    run_all([wbig, wsmall])
    st = arb.status()["models"]
    total = st["big"]["run_s"] + st["small"]["run_s"]
    # the small model goes first until its ~5 s usage average passes 0.1 (after ~0.6 s), then they take
    # turns by share: the big model is not starved
    assert st["big"]["run_s"] / total > 0.6


def test_separate_groups_run_side_by_side():
    arb = arbiter(bandwidth_priority=False)
    a, b = arb.register("a", "g1", 0.5, BE), arb.register("b", "g2", 0.5, BE)
    until = arb.clock() + 0.6
    wa, wb = Worker(a, 2, 0.005, until), Worker(b, 2, 0.005, until)
    run_all([wa, wb])
    assert wa.run_s == pytest.approx(0.6) and wb.run_s == pytest.approx(0.6)  # both ran all the time
    assert arb.status()["num_switches"] == 0


def test_bandwidth_priority_throttles_best_effort_and_relaxes():
    """Bandwidth priority: latency-critical steps over target -> best-effort duty falls (x0.5); calm -> it climbs back."""
    t = ThrottleConfig(increase=0.25, decrease=0.5, min_duty=0.1, interval_ms=50)
    arb = arbiter(throttle=t)
    small = arb.register("small", "g1", 0.5, LC, step_target_ms=5)
    big = arb.register("big", "g2", 0.5, BE)
    until = arb.clock() + 0.8
    # small's steps take 10 ms > its 5 ms target: pressure all along
    run_all([Worker(small, 2, 0.005, until), Worker(big, 2, 0.004, until)])
    st = arb.status()["models"]
    assert st["big"]["duty"] <= 0.2
    assert st["big"]["throttle_wait_s"] > 0.05
    ev = [e for e in arb.take_events() if e["type"] == "bandwidth_throttle"]
    assert ev and ev[0]["latency_critical"] == "small" and ev[0]["target_ms"] == 5.0
    # calm: fast steps -> duty back to 1 by additive steps
    until = arb.clock() + 0.8
    run_all([Worker(small, 1, 0.001, until), Worker(big, 1, 0.002, until)])
    assert arb.status()["models"]["big"]["duty"] == 1.0
    assert any(e.get("reason") == "calm" and e["duty"] == 1.0 for e in arb.take_events())


def test_learned_target_is_one_and_a_half_times_the_solo_median():
    arb = arbiter()
    small = arb.register("small", "g", 0.5, LC)
    run_all([Worker(small, 1, 0.004, arb.clock() + 10, steps=12)])
    target = arb.status()["models"]["small"]["step_target_ms"]
    assert target == pytest.approx(1.5 * 4)


def test_unregister_wakes_a_waiting_model():
    arb = arbiter()
    a, b = arb.register("a", "dev", 0.5, BE), arb.register("b", "dev", 0.5, BE)
    a.begin_step()  # a holds the group
    started = threading.Event()
    done = threading.Event()

    clock = arb._time

    def waiter():
        clock.join(expected=True)
        started.set()
        b.begin_step()
        done.set()
        clock.leave()

    clock.expect()
    threading.Thread(target=waiter, daemon=True).start()
    started.wait()
    clock.join()
    clock.sleep(0.05)  # virtual: passes only once the waiter blocks for its grant
    assert not done.is_set()
    clock.leave()
    b.close()
    assert done.wait(10)
    a.end_step()
    a.idle()
    assert arb.status()["groups"][0]["holder"] is None


def test_idle_hands_over_at_once():
    arb = arbiter(quantum_ms=50)
    a, b = arb.register("a", "dev", 0.5, BE), arb.register("b", "dev", 0.5, BE)
    a.begin_step()
    got = []

    clock = arb._time
    clock.join()

    def waiter():
        clock.join(expected=True)
        b.begin_step()
        got.append(clock.now())
        clock.leave()

    clock.expect()
    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    clock.sleep(0.01)  # virtual: passes only once the waiter blocks for its grant
    t_idle = clock.now()
    a.end_step()
    a.idle()
    clock.leave()
    th.join(10)
    assert got == [t_idle]  # at once, not after the 50 ms quantum
    ev = [e for e in arb.take_events() if e["type"] == "time_slice"]
    assert ev[-1]["reason"] == "idle" and ev[-1]["next"] == "b"


def test_reconfigure_changes_class_and_quantum():
    arb = arbiter()
    arb.register("a", "dev", 0.5, BE)
    new = cfg(quantum_ms=40)
    from gpuservd.sharing.config import ModelSharing

    new.models["a"] = ModelSharing(share=0.6, sharing_class=LC)
    arb.reconfigure(new, {"a": 0.6})
    st = arb.status()
    assert st["quantum_ms"] == 40 and st["models"]["a"]["class"] == "latency_critical"
    assert st["models"]["a"]["share"] == 0.6
    with pytest.raises(ValueError):
        arb.register("a", "dev", 0.5, BE)


def test_a_latency_critical_model_never_alone_gets_its_neighbours_held_back_to_learn_its_target():
    """Side by side with an always-busy best-effort model, the latency-critical model would never see a
    solo step: the controller holds the neighbour back ("calibrating") until it has, then has a target."""
    t = ThrottleConfig(increase=0.05, decrease=0.5, min_duty=0.05, interval_ms=30)
    arb = arbiter(throttle=t)
    small = arb.register("small", "g1", 0.5, LC)
    big = arb.register("big", "g2", 0.5, BE)
    until = arb.clock() + 2.0
    run_all([Worker(small, 2, 0.002, until), Worker(big, 2, 0.003, until)])
    st = arb.status()["models"]
    assert st["small"]["step_target_ms"] is not None
    ev = [e for e in arb.take_events() if e["type"] == "bandwidth_throttle"]
    assert any(e.get("reason") == "calibrating" for e in ev)


def test_device_memory_bandwidth_over_threshold_is_pressure():
    """Bandwidth priority on Hopper: NVML GPM's DRAM bandwidth use above the threshold throttles best effort even when the
    latency-critical model's steps look fine; an old or missing reading does nothing."""
    t = ThrottleConfig(increase=0.25, decrease=0.5, min_duty=0.1, interval_ms=20, mem_bw_threshold_pct=80)
    arb = arbiter(throttle=t)
    small = arb.register("small", "g1", 0.5, LC, step_target_ms=1000)  # its steps never pass this
    big = arb.register("big", "g2", 0.5, BE)
    arb.observe_readings({"mem_bw_util_pct": None})
    run_all([Worker(small, 1, 0.002, arb.clock() + 0.2), Worker(big, 1, 0.002, arb.clock() + 0.2)])
    assert arb.status()["models"]["big"]["duty"] == 1.0
    arb.observe_readings({"mem_bw_util_pct": 95.0})
    run_all([Worker(small, 1, 0.002, arb.clock() + 0.3), Worker(big, 1, 0.002, arb.clock() + 0.3)])
    assert arb.status()["models"]["big"]["duty"] < 1.0
    ev = [e for e in arb.take_events() if e["type"] == "bandwidth_throttle"]
    assert any(e.get("reason") == "memory bandwidth" and e["mem_bw_util_pct"] == 95.0 for e in ev)


def test_pressure_throttles_only_the_latency_critical_models_bandwidth_domain():
    """Separate GPUs have separate HBM: a slow latency-critical model on one does not throttle the other's."""
    t = ThrottleConfig(increase=0.25, decrease=0.5, min_duty=0.1, interval_ms=20)
    arb = arbiter(throttle=t)
    small = arb.register("small", "cuda:0", 0.5, LC, step_target_ms=1, bandwidth_domain="cuda:0")
    near = arb.register("near", "cuda:0/b", 0.5, BE, bandwidth_domain="cuda:0")
    far = arb.register("far", "cuda:1", 0.5, BE, bandwidth_domain="cuda:1")
    until = arb.clock() + 0.4
    run_all([Worker(small, 1, 0.004, until), Worker(near, 1, 0.002, until), Worker(far, 1, 0.002, until)])
    st = arb.status()["models"]
    assert st["near"]["duty"] < 1.0 and st["far"]["duty"] == 1.0

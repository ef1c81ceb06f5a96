"""The sharing-contention rule's overlap query: exact (a long neighbour step is found however many short ones
follow it) and a bisection per step, since the rule runs over the whole window on the daemon's event loop."""

from __future__ import annotations

from itertools import accumulate

from gpuservd.hints.rules_device import _overlaps


def _index(intervals):
    intervals = sorted(intervals)
    return [a for a, _ in intervals], list(accumulate((b for _, b in intervals), max))


def test_overlap_is_exact_behind_many_short_intervals():
    # one long step [0, 100], then 200 short ones after it, none reaching 150
    starts, reach = _index([(0.0, 100.0)] + [(1.0 + i * 0.1, 1.05 + i * 0.1) for i in range(200)])
    assert _overlaps(starts, reach, 90.0, 95.0)  # only the long step covers it, 200 intervals back
    assert not _overlaps(starts, reach, 120.0, 130.0)  # after everything
    assert not _overlaps(starts, reach, -5.0, -1.0)  # before everything
    assert _overlaps(starts, reach, 5.02, 5.03)  # inside a short one (and the long one)


def test_overlap_agrees_with_a_scan_of_every_interval():
    import random

    rng = random.Random(3)
    intervals = [(s, s + rng.expovariate(5.0)) for s in (rng.uniform(0, 50) for _ in range(300))]
    starts, reach = _index(intervals)
    for _ in range(500):
        a = rng.uniform(-1, 52)
        b = a + rng.expovariate(20.0)
        assert _overlaps(starts, reach, a, b) == any(s < b and e > a for s, e in intervals)

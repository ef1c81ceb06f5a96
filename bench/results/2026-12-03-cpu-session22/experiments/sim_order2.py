"""Simulate waiting-queue sort variants: python sim_order2.py VARIANT [--set ...]"""
import math, sys, runpy
from gpuservd.engine import scheduler as S, policy
V = sys.argv.pop(1)
def _order_waiting(self, seqs):
    def key(r):
        share = seqs.get(r.tenant, 0) / self.quota(r.tenant).weight
        c = self.claim(r)
        if V == "cheat":
            k = (0, -c) if policy.total_work(r) <= 200 else (1, c)
        elif V.startswith("band"):
            base = float(V[4:])
            k = (math.ceil(math.log(max(c, 1), base)), -c) if c > 0 else (-1, 0)
        else:
            k = (c,)
        return (-r.priority,) + k + (share,) + self._key(r)
    self.waiting.sort(key=key)
S.Scheduler._order_waiting = _order_waiting
sys.argv = ["burst_breakdown.py", "-w", "profiles/workloads/mixed-short-long.yaml", "-c", "profiles/engine/peers-48.yaml", ] + sys.argv[1:]
runpy.run_path("scripts/burst_breakdown.py", run_name="__main__")

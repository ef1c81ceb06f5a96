import sys, time, torch
sys.path.insert(0, "/work/main")
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import pack_pairs
ops = cpu_kernels.get()
torch.set_num_threads(2)
N = 212_000_000 // (576 * 2) // 16 * 16
p = pack_pairs(torch.randn(N, 576).to(torch.bfloat16))
q = p.clone()
r = torch.empty_like(p); r.copy_(p)
nb = p.numel() * 2
x = torch.randn(1, 576).to(torch.bfloat16)
x8 = torch.randn(8, 576).to(torch.bfloat16)
fs = {}
for name, t in (("huge_copy (product)", p), ("clone", q), ("empty_like+copy", r)):
    fs[f"sum {name}"] = (lambda t=t: t.view(-1).view(torch.float32).sum())
    fs[f"linear1 {name}"] = (lambda t=t: ops.packed_linear(x, t, N, None, False))
    fs[f"linear8 {name}"] = (lambda t=t: ops.packed_linear(x8, t, N, None, False))
res = {k: [] for k in fs}
for f in fs.values(): f()
for _ in range(10):
    for k, f in fs.items():
        t0 = time.perf_counter(); f(); res[k].append(time.perf_counter() - t0)
for k, v in res.items(): print(f"{k:30s} {min(v)*1e3:6.2f} ms {nb/min(v)/1e9:5.1f} GB/s")
import re
def smaps_huge(t):
    a = t.data_ptr()
    for line in open("/proc/self/smaps"):
        pass
print(open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(), open("/sys/kernel/mm/transparent_hugepage/defrag").read().strip())

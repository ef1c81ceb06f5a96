import sys, time, torch
sys.path.insert(0, "/work/main")
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import pack_pairs
ops = cpu_kernels.get()
torch.set_num_threads(2)
N = 212_000_000 // (576 * 2) // 16 * 16
p = pack_pairs(torch.randn(N, 576).to(torch.bfloat16))
parts = [pack_pairs(torch.randn(N // 100 // 16 * 16 + 16, 576).to(torch.bfloat16)) for _ in range(101)]
c = torch.cat([t.view(-1) for t in parts])
cp = c[: p.numel()].view(p.shape)
a = torch.arange(p.numel() // 2, dtype=torch.float32)
ap = a.view(torch.bfloat16).view(p.shape)
nb = p.numel() * 2
x = torch.randn(1, 576).to(torch.bfloat16)
fs = {}
for name, t in (("pack_pairs", p), ("cat", cp), ("arange", ap)):
    fs[f"sum {name}"] = (lambda t=t: t.reshape(-1).view(torch.float32).sum())
    fs[f"linear1 {name}"] = (lambda t=t: ops.packed_linear(x, t, N, None, False))
res = {k: [] for k in fs}
for f in fs.values(): f()
for _ in range(10):
    for k, f in fs.items():
        t0 = time.perf_counter(); f(); res[k].append(time.perf_counter() - t0)
for k, v in res.items(): print(f"{k:30s} {min(v)*1e3:6.2f} ms {nb/min(v)/1e9:5.1f} GB/s")

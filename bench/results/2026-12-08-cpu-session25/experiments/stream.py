# How fast does packed_linear stream SmolLM2's bf16 weights at 1-8 rows, against torch.sum of the same bytes?
import sys, time, statistics, torch
sys.path.insert(0, "/work/main")
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import pack_pairs
ops = cpu_kernels.get()
torch.set_num_threads(2)
H, I, L = 576, 1536, 30
shapes = [(960, H), (H, H), (2 * I, H), (H, I)]
torch.manual_seed(0)
layers = [[pack_pairs(torch.randn(n, k).to(torch.bfloat16) * 0.02) for (n, k) in shapes] for _ in range(L)]
nbytes = sum(p.numel() * 2 for ws in layers for p in ws)
def run(rows):
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (H, I)}
    t = time.perf_counter()
    for ws in layers:
        for (n, k), p in zip(shapes, ws):
            ops.packed_linear(xs[k], p, n, None, False)
    return time.perf_counter() - t
def sums():
    t = time.perf_counter()
    for ws in layers:
        for p in ws:
            p.sum()
    return time.perf_counter() - t
def flat():
    t = time.perf_counter(); big.sum(); return time.perf_counter() - t
big = torch.cat([p.view(-1) for ws in layers for p in ws])
for name, f in [("rows1", lambda: run(1)), ("rows8", lambda: run(8)), ("rows16", lambda: run(16)), ("sum-per-weight(bf16)", sums), ("sum-flat(bf16)", flat)]:
    f()
    ts = [f() for _ in range(15)]
    print(f"{name:22s} {nbytes/1e6:.0f} MB  min {min(ts)*1e3:6.2f} ms  med {statistics.median(ts)*1e3:6.2f} ms  {nbytes/min(ts)/1e9:5.1f} GB/s")
big32 = big.view(torch.float32)
l32 = [p.view(-1).view(torch.float32) for ws in layers for p in ws]
def sums32():
    t = time.perf_counter()
    for p in l32: p.sum()
    return time.perf_counter() - t
def flat32():
    t = time.perf_counter(); big32.sum(); return time.perf_counter() - t
for name, f in [("sum-per-weight(f32view)", sums32), ("sum-flat(f32view)", flat32), ("rows1", lambda: run(1))]:
    f()
    ts = [f() for _ in range(15)]
    print(f"{name:22s} {nbytes/1e6:.0f} MB  min {min(ts)*1e3:6.2f} ms  med {statistics.median(ts)*1e3:6.2f} ms  {nbytes/min(ts)/1e9:5.1f} GB/s")

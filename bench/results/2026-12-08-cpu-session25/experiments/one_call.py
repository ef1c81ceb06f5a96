import sys, time, statistics, torch
sys.path.insert(0, "/work/main")
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import pack_pairs
ops = cpu_kernels.get()
torch.set_num_threads(2)
N = 212_000_000 // (576 * 2) // 16 * 16
p = pack_pairs(torch.randn(N, 576).to(torch.bfloat16))
nb = p.numel() * 2
for rows in (1, 8):
    x = torch.randn(rows, 576).to(torch.bfloat16)
    ops.packed_linear(x, p, N, None, False)
    ts = []
    for _ in range(15):
        t = time.perf_counter(); ops.packed_linear(x, p, N, None, False); ts.append(time.perf_counter() - t)
    print(f"one call rows{rows}: {nb/1e6:.0f} MB min {min(ts)*1e3:.2f} ms {nb/min(ts)/1e9:.1f} GB/s")
# the same weight cut in 120 calls of equal size
parts = [pack_pairs(torch.randn(N // 120 // 16 * 16, 576).to(torch.bfloat16)) for _ in range(120)]
n1 = N // 120 // 16 * 16
nb2 = sum(q.numel() * 2 for q in parts)
x = torch.randn(1, 576).to(torch.bfloat16)
ts = []
for _ in range(15):
    t = time.perf_counter()
    for q in parts: ops.packed_linear(x, q, n1, None, False)
    ts.append(time.perf_counter() - t)
print(f"120 calls rows1: {nb2/1e6:.0f} MB min {min(ts)*1e3:.2f} ms {nb2/min(ts)/1e9:.1f} GB/s")

import sys, time, torch
sys.path.insert(0, "/work/main")
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import pack_pairs
ops = cpu_kernels.get()
for threads in (1, 2):
    torch.set_num_threads(threads)
    for n, k in ((576, 576), (960, 576), (1536, 576)):
        p = pack_pairs((torch.randn(n, k) * 0.02).to(torch.bfloat16))
        for rows in (1, 8):
            x = torch.randn(rows, k).to(torch.bfloat16)
            for _ in range(50): ops.packed_linear(x, p, n, None, False)
            R = 2000
            t = time.perf_counter()
            for _ in range(R): ops.packed_linear(x, p, n, None, False)
            dt = (time.perf_counter() - t) / R
            print(f"threads {threads} {n}x{k} ({p.numel()*2/1e6:.2f} MB) rows {rows}: {dt*1e6:6.1f} us  {p.numel()*2/dt/1e9:5.1f} GB/s  {2*rows*n*k/dt/1e9:6.1f} GFLOP/s")

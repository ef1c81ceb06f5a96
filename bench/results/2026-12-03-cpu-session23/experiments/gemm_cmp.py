import torch, time
torch.set_num_threads(2)
from gpuservd.runner import cpu_kernels; cpu_kernels.get()
ops = torch.ops.gpuserv
def bench(f, reps=30):
    f(); ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//4]
for (N,K) in [(3072,576),(576,1536),(960,576)]:
    W = torch.randn(N,K)
    P = ops.pack_panels_f32(W, True)
    for M in [48, 213]:
        x = torch.randn(M,K)
        fl = 2*M*N*K
        t1 = bench(lambda: torch.nn.functional.linear(x, W))
        t2 = bench(lambda: ops.packed_linear_f32(x, P, N, None, 0))
        print(f"N={N} K={K} M={M}: torch {fl/t1/1e9:.0f} GFLOP/s, panels f32 {fl/t2/1e9:.0f}")

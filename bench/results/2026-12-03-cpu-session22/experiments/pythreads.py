"""Two Python threads, each running 1-thread GEMMs on its own x, W, y (the GIL is released in the op)."""
import threading, time, torch, sys
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import pack_panels
ops = cpu_kernels.get()
torch.set_num_threads(1)
n, k, rows = int(sys.argv[1]), 576, 48
mode = sys.argv[2]  # own | shared
W = [pack_panels(torch.randn(n, k)) for _ in range(2)]
X = [torch.randn(rows, k) for _ in range(2)]
Y = [torch.empty(rows, n) for _ in range(2)]
it = int(1.5e10 / (2 * rows * n * k))
res = [0.0, 0.0]
def work(i):
    j = i if mode == "own" else 0
    t = time.perf_counter()
    for _ in range(it): ops.packed_linear_f32_out(X[j], W[j], n, None, Y[i])
    res[i] = 2 * rows * n * k * it / (time.perf_counter() - t) / 1e9
for nthreads in (1, 2):
    ts = [threading.Thread(target=work, args=(i,)) for i in range(nthreads)]
    [t.start() for t in ts]; [t.join() for t in ts]
    print(f"N={n} {mode} {nthreads} python threads: " + " + ".join(f"{r:.0f}" for r in res[:nthreads]) + f" = {sum(res[:nthreads]):.0f} GFLOP/s")

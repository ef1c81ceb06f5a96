import time, torch, sys, resource
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import pack_panels
ops = cpu_kernels.get()
torch.set_num_threads(int(sys.argv[1]))
for n, k, rows in ((3072, 576, 48), (576, 576, 48)):
    p = pack_panels(torch.randn(n, k)); x = torch.randn(rows, k); y = torch.empty(rows, n)
    it = int(3e10 / (2 * rows * n * k))
    for _ in range(10): ops.packed_linear_f32_out(x, p, n, None, y)
    r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
    for _ in range(it): ops.packed_linear_f32_out(x, p, n, None, y)
    wall = time.perf_counter() - t; r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    print(f"{n}x{rows}: {2*rows*n*k*it/wall/1e9:.0f} GFLOP/s, cpu/wall {cpu/wall:.2f}, sys {r1.ru_stime - r0.ru_stime:.2f}s, vcsw {r1.ru_nvcsw-r0.ru_nvcsw} ivcsw {r1.ru_nivcsw-r0.ru_nivcsw}, {wall/it*1e6:.0f} us/call")

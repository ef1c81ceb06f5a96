import time, torch, sys
from gpuservd.runner import cpu_kernels, q4_panels
from gpuservd.runner.linear import pack_panels
import numpy as np
from gguf.quants import quantize, dequantize
from gguf import GGMLQuantizationType as T
ops = cpu_kernels.get()
torch.set_num_threads(int(sys.argv[1]))
n, k = 3072, 576
w = torch.from_numpy(dequantize(quantize(np.random.randn(n, k).astype(np.float32) * .05, T.Q4_1), T.Q4_1).astype(np.float32))
qp, fp = ops.pack_panels_q4(w), pack_panels(w)
for rows in (1, 2, 4, 6, 7, 8, 12, 16, 48):
    x = torch.randn(rows, k)
    r = {}
    for name, p in (("q4", qp), ("fp32", fp)):
        best = 1e9
        for rep in range(30):
            t = time.perf_counter(); ops.packed_linear_f32(x, p, n, None); best = min(best, time.perf_counter() - t)
        r[name] = best * 1e3
    print(f"rows {rows:2d}: q4 {r['q4']:.3f} ms  fp32 {r['fp32']:.3f} ms  ({2*rows*n*k/r['q4']/1e6:.0f} / {2*rows*n*k/r['fp32']/1e6:.0f} GFLOP/s)")

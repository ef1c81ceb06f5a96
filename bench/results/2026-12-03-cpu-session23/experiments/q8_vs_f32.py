import sys, time, statistics
import numpy as np, torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from gpuservd.runner import cpu_kernels
ops = cpu_kernels.get(); torch.set_num_threads(int(sys.argv[1]))
w = np.random.default_rng(0).standard_normal((49152, 576)).astype(np.float32) * 0.05
w = torch.from_numpy(np.ascontiguousarray(dequantize(quantize(w, T.Q8_0), T.Q8_0), dtype=np.float32))
n, k = w.shape
for N in (49152, 6144):
    q8 = ops.pack_panels_q8(w[:N].contiguous()); f32 = ops.pack_panels_f32(w[:N].contiguous(), True)
    for m in (4, 8, 48):
        x = torch.randn(m, k); y = torch.empty(m, N)
        res = {}
        for name, p in (("q8", q8), ("f32", f32)) * 2:
            ts = []
            for rep in range(10 if N > 10000 else 80):
                t = time.perf_counter(); ops.packed_linear_f32_out(x, p, N, None, y); ts.append(time.perf_counter() - t)
            res[name] = 2 * m * N * k / statistics.median(ts) / 1e9
        print(N, m, {a: round(b) for a, b in res.items()}, flush=True)

"""packed_linear_f32 at 1-48 rows on SmolLM2-shaped weights in fp32, 4-bit (Q4_1) and 8-bit (Q8_0) panels:
GFLOP/s, 2 threads, wall time, several weights cycled (as a step meets them: from DRAM)."""
import sys, time, statistics
import numpy as np, torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from gpuservd.runner import cpu_kernels
ops = cpu_kernels.get(); torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
def grid(n, k, t, seed):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return torch.from_numpy(np.ascontiguousarray(dequantize(quantize(w, t), t), dtype=np.float32))
cases = {"lm_head 49152x576 q8": [ops.pack_panels_q8(grid(49152, 576, T.Q8_0, 0))],
         "gate_up 3072x576 q4 x8": [ops.pack_panels_q4(grid(3072, 576, T.Q4_1, s)) for s in range(8)]}
cases["lm_head fp32"] = [ops.pack_panels_f32(grid(49152, 576, T.Q8_0, 0), True)]
shapes = {"lm_head 49152x576 q8": (49152, 576), "gate_up 3072x576 q4 x8": (3072, 576), "lm_head fp32": (49152, 576)}
for name, ws in cases.items():
    n, k = shapes[name]
    line = []
    for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 48):
        x = torch.randn(m, k)
        ts = []
        for rep in range(12 if n > 10000 else 6):
            t = time.perf_counter()
            for w in ws: ops.packed_linear_f32(x, w, n, None, 0)
            ts.append((time.perf_counter() - t) / len(ws))
        line.append(f"{m}:{2 * m * n * k / statistics.median(ts) / 1e9:.0f}")
    print(name, " ".join(line), flush=True)

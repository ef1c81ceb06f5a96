"""Code panels at 1-12 rows: the register-expanded narrow path (tile_rows 0) against the buffered 6-row tiles
(tile_rows 6) on the same panels, and fp32 panels of the same weight; GFLOP/s, the best of alternated
medians. argv: threads, N (output columns), weights cycled."""
import sys, time, statistics
import numpy as np, torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from gpuservd.runner import cpu_kernels
ops = cpu_kernels.get(); torch.set_num_threads(int(sys.argv[1]))
N = int(sys.argv[2]); nw = int(sys.argv[3]); k = 576
clock = time.thread_time if sys.argv[1] == "1" else time.perf_counter
def grid(t, seed):
    w = np.random.default_rng(seed).standard_normal((N, k)).astype(np.float32) * 0.05
    return torch.from_numpy(np.ascontiguousarray(dequantize(quantize(w, t), t), dtype=np.float32))
w8 = [grid(T.Q8_0, s) for s in range(nw)]; w4 = [grid(T.Q4_1, s) for s in range(nw)]
P = {"q8": [ops.pack_panels_q8(w) for w in w8], "q4": [ops.pack_panels_q4(w) for w in w4],
     "f32": [ops.pack_panels_f32(w, True) for w in w8]}
print(f"{sys.argv[1]} threads, {N} x {k}, {nw} weights; GFLOP/s narrow / buffered (f32: tiles)")
for m in [int(v) for v in (sys.argv[4].split(",") if len(sys.argv) > 4 else "1,2,3,4,5,6,8,10,12".split(","))]:
    x = torch.randn(m, k); y = torch.empty(m, N)
    res = {}
    for rep in range(3):
        for name, ps in P.items():
            for tr in ((0,) if name == "f32" else (0, 6)):
                ts = []
                for _ in range(8):
                    t = clock()
                    for p in ps: ops.packed_linear_f32_out(x, p, N, None, y) if tr == 0 else ops.packed_linear_f32(x, p, N, None, tr)
                    ts.append((clock() - t) / len(ps))
                key = f"{name}/{tr}"
                res[key] = max(res.get(key, 0), 2 * m * N * k / statistics.median(ts) / 1e9)
    print(m, "q8 %.0f / %.0f  q4 %.0f / %.0f  f32 %.0f" % (res["q8/0"], res["q8/6"], res["q4/0"], res["q4/6"], res["f32/0"]), flush=True)

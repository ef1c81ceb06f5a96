"""A decode step's linears (SmolLM2 shapes, 30 layers, weights streamed as in a step): q4 panels vs fp32 panels."""
import sys, time, torch, numpy as np
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import pack_panels
from gguf.quants import quantize, dequantize
from gguf import GGMLQuantizationType as T
ops = cpu_kernels.get()
torch.set_num_threads(2)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
layers = {"q4": [], "fp32": []}
base = {}
for n, k in shapes:
    base[(n, k)] = torch.from_numpy(dequantize(quantize(np.random.randn(n, k).astype(np.float32) * .05, T.Q4_1), T.Q4_1).astype(np.float32))
for L in range(30):
    for n, k in shapes:
        w = base[(n, k)] + 0  # same grid: distinct copies
        layers["q4"].append((ops.pack_panels_q4(w), n, k))
        layers["fp32"].append((pack_panels(w), n, k))
for rows in [int(r) for r in sys.argv[1].split(",")]:
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    ys = {n: torch.empty(rows, n) for n, _ in shapes}
    res = {"q4": [], "fp32": []}
    for rep in range(10):
        for tag in (("q4", "fp32") if rep % 2 else ("fp32", "q4")):
            t = time.perf_counter()
            for p, n, k in layers[tag]:
                ops.packed_linear_f32_out(xs[k], p, n, None, ys[n])
            res[tag].append(time.perf_counter() - t)
    q, f = sorted(res["q4"]), sorted(res["fp32"])
    print(f"rows {rows:3d}: q4 min {q[0]*1e3:.1f} med {q[5]*1e3:.1f} ms | fp32 min {f[0]*1e3:.1f} med {f[5]*1e3:.1f} ms")

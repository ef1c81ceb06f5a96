"""A/B of packed_linear_f32 on 4-bit panels: this tree's kernel against HEAD's, cold weights (30 copies)."""
import sys, time, torch, numpy as np
sys.path.insert(0, "scripts")
from bench_cpu_kernels import kernel_at_revision
from gpuservd.runner import cpu_kernels
from gguf.quants import quantize, dequantize
from gguf import GGMLQuantizationType as T
ops = cpu_kernels.get()
base = kernel_at_revision("HEAD", "packed_gemm_f32.cpp", "gpuserv_base")
torch.set_num_threads(2)
shapes = {"gate_up": (3072, 576), "down": (576, 1536), "qkv": (960, 576)}
for name, (n, k) in shapes.items():
    w = torch.from_numpy(dequantize(quantize(np.random.randn(n, k).astype(np.float32) * .05, T.Q4_1), T.Q4_1).astype(np.float32))
    copies = [ops.pack_panels_q4(w + 0) for _ in range(30)]
    for rows in [int(r) for r in sys.argv[1].split(",")]:
        x = torch.randn(rows, k)
        assert torch.equal(ops.packed_linear_f32(x, copies[0], n, None), base.packed_linear_f32(x, copies[0], n, None))
        res = {"new": [], "base": []}
        for rep in range(12):
            for tag, f in ((("new", ops), ("base", base)) if rep % 2 else (("base", base), ("new", ops))):
                t = time.perf_counter()
                for p in copies:
                    f.packed_linear_f32(x, p, n, None)
                res[tag].append((time.perf_counter() - t) / len(copies))
        b, nn = min(res["base"]), min(res["new"])
        mb, mn = sorted(res["base"])[6], sorted(res["new"])[6]
        print(f"{name:8s} rows {rows:3d}: base {b*1e3:.3f} new {nn*1e3:.3f} ms (min ratio {b/nn:.3f}, median ratio {mb/mn:.3f}), new {2*rows*n*k/nn/1e9:.0f} GFLOP/s")

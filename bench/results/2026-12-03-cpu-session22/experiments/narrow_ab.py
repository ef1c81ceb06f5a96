import os, sys, time, torch, numpy as np
from gpuservd.runner import cpu_kernels
from gguf.quants import quantize, dequantize
from gguf import GGMLQuantizationType as T
ops = cpu_kernels.get()
torch.set_num_threads(2)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (100, 64)]
# bit identity, with and without bias, odd N
for n, k in shapes:
    w = torch.from_numpy(dequantize(quantize(np.random.randn(n, k).astype(np.float32) * .05, T.Q4_1), T.Q4_1).astype(np.float32))
    qp = ops.pack_panels_q4(w)
    assert qp.numel(), (n, k)
    for rows in (1, 2):
        x = torch.randn(rows, k)
        for bias in (None, torch.randn(n)):
            os.environ["GPUSERV_EXP_NONARROW"] = "1"; ref = ops.packed_linear_f32(x, qp, n, bias)
            os.environ.pop("GPUSERV_EXP_NONARROW"); new = ops.packed_linear_f32(x, qp, n, bias)
            assert torch.equal(ref.view(torch.int32), new.view(torch.int32)), (n, k, rows, (ref - new).abs().max())
print("bit-identical")
layers = []
for L in range(30):
    for n, k in shapes[:4]:
        w = torch.from_numpy(dequantize(quantize(np.random.randn(n, k).astype(np.float32) * .05, T.Q4_1), T.Q4_1).astype(np.float32))
        layers.append((ops.pack_panels_q4(w), n, k))
for rows in (1, 2):
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    ys = {n: torch.empty(rows, n) for n, _ in shapes}
    res = {"buffered": [], "narrow": []}
    for rep in range(12):
        for tag in (("buffered", "narrow") if rep % 2 else ("narrow", "buffered")):
            if tag == "buffered": os.environ["GPUSERV_EXP_NONARROW"] = "1"
            else: os.environ.pop("GPUSERV_EXP_NONARROW", None)
            t = time.perf_counter()
            for p, n, k in layers: ops.packed_linear_f32_out(xs[k], p, n, None, ys[n])
            res[tag].append(time.perf_counter() - t)
    b, nn = sorted(res["buffered"]), sorted(res["narrow"])
    print(f"rows {rows}: buffered min {b[0]*1e3:.1f} med {b[6]*1e3:.1f} ms | narrow min {nn[0]*1e3:.1f} med {nn[6]*1e3:.1f} ms")

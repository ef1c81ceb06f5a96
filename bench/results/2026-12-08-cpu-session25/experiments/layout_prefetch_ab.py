"""The packed bf16 kernel against its variants (variant_source.py), alternated in one process, over 30
layers of SmolLM2's projections; every mode is checked bit-identical to the product's op first."""
import os, sys, time, statistics, torch
from pathlib import Path
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(HERE))
from torch.utils.cpp_extension import load
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import pack_pairs
import variant_source
ops = cpu_kernels.get()
source = variant_source.write(ROOT, Path("/tmp/gpx-build"))
load(name="gpx_ext", sources=[str(source)], extra_cflags=cpu_kernels._cflags(), extra_ldflags=["-fopenmp"],
     build_directory="/tmp/gpx-build", is_python_module=False, verbose=False)
gpx = torch.ops.gpx
torch.set_num_threads(2)
def inter(p):
    P, K2, _ = p.shape
    full = P // 3 * 3
    parts = [p[:full].view(P // 3, 3, K2, 32).permute(0, 2, 1, 3).reshape(-1)]
    if full < P:
        r = P - full
        parts.append(p[full:].view(1, r, K2, 32).permute(0, 2, 1, 3).reshape(-1))
    return torch.cat(parts).view(P, K2, 32).contiguous()
H, I, L = 576, 1536, 30
shapes = [(960, H), (H, H), (2 * I, H), (H, I), ]
torch.manual_seed(0)
dense = [[(torch.randn(n, k) * 0.02).to(torch.bfloat16) for (n, k) in shapes] for _ in range(L)]
pan = [[pack_pairs(w) for w in ws] for ws in dense]
pin = [[inter(p) for p in ws] for ws in pan]
nbytes = sum(p.numel() * 2 for ws in pan for p in ws)
# correctness: every mode equals the product's op
for rows in (1, 5, 8, 13):
    for (n, k), p, q in zip(shapes, pan[0], pin[0]):
        x = torch.randn(rows, k).to(torch.bfloat16)
        ref = ops.packed_linear(x, p, n, None, False)
        for mode, w in ((0, p), (1, p), (2, q), (3, q), (4, p), (5, p)):
            y = gpx.packed_linear(x, w, n, None, False, mode)
            assert torch.equal(y, ref), (rows, n, k, mode)
print("all modes bit-identical")
def run(rows, mode):
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (H, I)}
    src = pin if mode & 2 else pan
    def f():
        t = time.perf_counter()
        for ws in src:
            for (n, k), p in zip(shapes, ws):
                gpx.packed_linear(xs[k], p, n, None, False, mode)
        return time.perf_counter() - t
    return f
MODES = [int(m) for m in os.environ.get("MODES", "0,1,2,3").split(",")]  # session 25 also ran MODES=0,1,4,5
for rows in (1, 2, 8, 16, 48):
    fs = {m: run(rows, m) for m in MODES}
    res = {m: [] for m in fs}
    for f in fs.values(): f()
    for _ in range(12):
        for m, f in fs.items(): res[m].append(f())
    print(f"rows {rows:2d}: " + "  ".join(f"mode{m} {min(v)*1e3:6.2f} ms ({nbytes/min(v)/1e9:4.1f} GB/s)" for m, v in res.items()))

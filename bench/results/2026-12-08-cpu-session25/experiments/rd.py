import sys, time, torch, os
sys.path.insert(0, "/work/main")
from torch.utils.cpp_extension import load
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import pack_pairs
ops = cpu_kernels.get()
os.makedirs("/tmp/gprd", exist_ok=True)
load(name="gprd_ext", sources=[__file__.rsplit("/", 1)[0] + "/rd.cpp"], extra_cflags=cpu_kernels._cflags(), extra_ldflags=["-fopenmp"],
     build_directory="/tmp/gprd", is_python_module=False, verbose=False)
torch.set_num_threads(2)
N = 212_000_000 // (576 * 2) // 16 * 16
p = pack_pairs(torch.randn(N, 576).to(torch.bfloat16))
nb = p.numel() * 2
x = torch.randn(1, 576).to(torch.bfloat16)
flat = p.view(-1).view(torch.float32)
fs = {"rd flat": lambda: torch.ops.gprd.rd(p, 0), "rd kernel order": lambda: torch.ops.gprd.rd(p, 1),
      "packed_linear 1 row": lambda: ops.packed_linear(x, p, N, None, False), "torch.sum f32 view": lambda: flat.sum()}
res = {k: [] for k in fs}
for f in fs.values(): f()
for _ in range(10):
    for k, f in fs.items():
        t = time.perf_counter(); f(); res[k].append(time.perf_counter() - t)
for k, v in res.items(): print(f"{k:22s} {min(v)*1e3:6.2f} ms {nb/min(v)/1e9:5.1f} GB/s")

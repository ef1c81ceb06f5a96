import sys, time, torch
sys.path.insert(0, __file__.rsplit('/', 1)[0])
import alternate, os
from torch.utils.cpp_extension import load
from gpuservd.runner import cpu_kernels
ops, N, p = alternate.packed_weight()
os.makedirs("/tmp/gprd", exist_ok=True)
load(name="gprd_ext", sources=[__file__.rsplit("/", 1)[0] + "/rd.cpp"], extra_cflags=cpu_kernels._cflags(), extra_ldflags=["-fopenmp"],
     build_directory="/tmp/gprd", is_python_module=False, verbose=False)
nb = p.numel() * 2
x = torch.randn(1, 576).to(torch.bfloat16)
flat = p.view(-1).view(torch.float32)
fs = {"rd flat": lambda: torch.ops.gprd.rd(p, 0), "rd kernel order": lambda: torch.ops.gprd.rd(p, 1),
      "packed_linear 1 row": lambda: ops.packed_linear(x, p, N, None, False), "torch.sum f32 view": lambda: flat.sum()}
alternate.report(fs, nb, width=22)

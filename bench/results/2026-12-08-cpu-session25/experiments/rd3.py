import sys, time, torch
sys.path.insert(0, __file__.rsplit('/', 1)[0])
import alternate
ops, N, p = alternate.packed_weight()
from gpuservd.runner.linear import pack_pairs
parts = [pack_pairs(torch.randn(N // 100 // 16 * 16 + 16, 576).to(torch.bfloat16)) for _ in range(101)]
c = torch.cat([t.view(-1) for t in parts])
cp = c[: p.numel()].view(p.shape)
a = torch.arange(p.numel() // 2, dtype=torch.float32)
ap = a.view(torch.bfloat16).view(p.shape)
nb = p.numel() * 2
x = torch.randn(1, 576).to(torch.bfloat16)
fs = {}
for name, t in (("pack_pairs", p), ("cat", cp), ("arange", ap)):
    fs[f"sum {name}"] = (lambda t=t: t.reshape(-1).view(torch.float32).sum())
    fs[f"linear1 {name}"] = (lambda t=t: ops.packed_linear(x, t, N, None, False))
alternate.report(fs, nb, width=30)

import sys, time, torch
sys.path.insert(0, __file__.rsplit('/', 1)[0])
import alternate
ops, N, p = alternate.packed_weight()
q = p.clone()
r = torch.empty_like(p); r.copy_(p)
nb = p.numel() * 2
x = torch.randn(1, 576).to(torch.bfloat16)
x8 = torch.randn(8, 576).to(torch.bfloat16)
fs = {}
for name, t in (("huge_copy (product)", p), ("clone", q), ("empty_like+copy", r)):
    fs[f"sum {name}"] = (lambda t=t: t.view(-1).view(torch.float32).sum())
    fs[f"linear1 {name}"] = (lambda t=t: ops.packed_linear(x, t, N, None, False))
    fs[f"linear8 {name}"] = (lambda t=t: ops.packed_linear(x8, t, N, None, False))
alternate.report(fs, nb, width=30)
print(open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(), open("/sys/kernel/mm/transparent_hugepage/defrag").read().strip())

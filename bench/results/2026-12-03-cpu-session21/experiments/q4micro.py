import time, torch, os
from pathlib import Path
from gpuservd.runner.load import load_weights
from gpuservd.runner.model_config import load_arch
from gpuservd.runner import cpu_kernels
ops = cpu_kernels.get()
d = Path.home() / ".local/share/gpuserv/models/smollm2"; arch = load_arch(d)
res = {}
for sw in ("1", "0"):
    os.environ["GPUSERV_PANELS_Q4"] = sw
    w = load_weights(d, arch, torch.float32, torch.device("cpu"))
    lins = [getattr(w.layer(i), n) for i in range(arch.num_layers) for n in ("qkv", "o_proj", "gate_up", "down")]
    for rows in (1, 8, 48):
        xs = {l.in_features: torch.randn(rows, l.in_features) for l in lins}
        best = 1e9
        for rep in range(5):
            t = time.perf_counter()
            for l in lins:
                ops.packed_linear_f32(xs[l.in_features], l.packed, l.out_features, l.bias)
            best = min(best, time.perf_counter() - t)
        hx = torch.randn(rows, 576); hb = 1e9
        for rep in range(5):
            t = time.perf_counter(); w.lm_head.fp32(hx); hb = min(hb, time.perf_counter() - t)
        print(f"q4={sw} rows {rows:2d}: 120 linears {1e3*best:6.2f} ms, head {1e3*hb:5.2f} ms")
    del w, lins

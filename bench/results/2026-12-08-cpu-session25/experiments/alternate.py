"""Time callables alternated in one process (one warm-up call each, then `reps` rounds); print each one's best
time and the read rate it gives for `nbytes`. Alternating is the point: this VM's read rate moves from one
second to the next, so cases run one after the other are not comparable."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root


def packed_weight():
    """(the product's ops, N, SmolLM2's bytes of projections as one [N, 576] bf16 pair-panel weight, ~212 MB),
    2 torch threads."""
    import torch
    from gpuservd.runner import cpu_kernels
    from gpuservd.runner.linear import pack_pairs
    torch.set_num_threads(2)
    n = 212_000_000 // (576 * 2) // 16 * 16
    return cpu_kernels.get(), n, pack_pairs(torch.randn(n, 576).to(torch.bfloat16))


def report(fs: dict, nbytes: int, reps: int = 10, width: int = 30) -> None:
    res = {k: [] for k in fs}
    for f in fs.values():
        f()
    for _ in range(reps):
        for k, f in fs.items():
            t0 = time.perf_counter(); f(); res[k].append(time.perf_counter() - t0)
    for k, v in res.items():
        print(f"{k:{width}s} {min(v)*1e3:6.2f} ms {nbytes/min(v)/1e9:5.1f} GB/s")

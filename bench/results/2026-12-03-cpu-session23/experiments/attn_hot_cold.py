"""Decode attention (paged_decode, fp32, SmolLM2's shape) with its KV in cache (one layer's cache called
again and again) against out of cache (30 layers' caches in turn): memory-bound or not. argv: threads, BxCTX."""
import statistics, sys, time
import torch
sys.path.insert(0, "scripts")
from bench_cpu_kernels import BLOCK, HEAD_DIM, HEADS, KV_HEADS
from gpuservd.runner import cpu_kernels
from gpuservd.runner.batch import SeqChunk, build_batch
ops = cpu_kernels.get(); threads = int(sys.argv[1]); torch.set_num_threads(threads)
clock = time.perf_counter if threads > 1 else time.process_time
b, ctx = (int(v) for v in sys.argv[2].split("x"))
g = torch.Generator().manual_seed(0)
need = -(-ctx // BLOCK); nb = b * need
caches = [(torch.randn(nb, BLOCK, KV_HEADS, HEAD_DIM, generator=g), torch.randn(nb, BLOCK, KV_HEADS, HEAD_DIM, generator=g)) for _ in range(30)]
perm = torch.randperm(nb, generator=g).tolist()
fb = build_batch([SeqChunk([0], ctx - 1, perm[i * need:(i + 1) * need], True) for i in range(b)], BLOCK, torch.device("cpu"))
q = torch.randn(b, HEADS, HEAD_DIM, generator=g)
def run(layers):
    t = clock()
    for l in layers:
        k, v = caches[l]; ops.paged_decode(q, k, v, fb.decode_block_table, fb.decode_ctx_lens, HEAD_DIM ** -0.5)
    return (clock() - t) / len(layers)
kv = b * ctx * KV_HEADS * HEAD_DIM * 2 * 4
hot, cold = [], []
with torch.inference_mode():
    run([0] * 5)
    for _ in range(10):
        hot.append(run([0] * 30)); cold.append(run(list(range(30))))
h, c = statistics.median(hot), statistics.median(cold)
print(f"{b}x{ctx}, {threads} threads: hot {1e6 * h:.0f} us ({kv / h / 1e9:.1f} GB/s), cold {1e6 * c:.0f} us ({kv / c / 1e9:.1f} GB/s)")

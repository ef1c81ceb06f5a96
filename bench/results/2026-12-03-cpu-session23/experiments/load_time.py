import time, sys
from pathlib import Path
from gpuservd.runner import cpu_kernels; cpu_kernels.get()
from gpuservd.config import EngineConfig
from gpuservd.engine.engine import LLMEngine
p = Path.home() / ".local/share/gpuserv/models/smollm2"
t = time.perf_counter()
eng = LLMEngine("smollm2", p, EngineConfig(model="smollm2", dtype="float32", kv_cache_bytes=64 << 20))
print(sys.argv[1], f"load {time.perf_counter() - t:.2f} s", eng.runner.weights.lm_head.packed.shape)

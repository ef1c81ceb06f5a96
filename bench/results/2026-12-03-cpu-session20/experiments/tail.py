import time, cProfile, pstats, os
from gpuservd.config import load_config
from gpuservd.engine.engine import LLMEngine
from gpuservd.store.store import ModelStore
from gpuservd.runner import cpu_isa
from gpuservd.bench.engine_run import _params, warm_up
from gpuservd.kv_cache.prefault import PoolCommitter
cpu_isa.apply()
cfg = load_config("profiles/engine/peers-48.yaml"); cfg.model = "smollm2"
eng = LLMEngine(cfg.model, ModelStore().path(cfg.model), cfg)
PoolCommitter.for_cache(eng.runner.cache).commit_all()
warm_up(eng)
for i in range(8):
    eng.add_request(f"r{i}", [100 + (i * 7 + j) % 3000 for j in range(50)], _params(400))
for _ in range(20): eng.step()
fwd = [0.0]
inner = eng.runner.execute
def ex(*a, **k):
    t = time.perf_counter(); r = inner(*a, **k); fwd[0] += time.perf_counter() - t; return r
eng.runner.execute = ex
n = int(os.environ.get("NSTEPS", "200"))
pr = cProfile.Profile() if os.environ.get("PROF") else None
t = time.perf_counter()
if pr: pr.enable()
for _ in range(n): eng.step()
if pr: pr.disable()
w = time.perf_counter() - t
print(f"step {1e3*w/n:.2f} ms, execute {1e3*fwd[0]/n:.2f} ms")
if pr: pstats.Stats(pr).sort_stats("tottime").print_stats(18)

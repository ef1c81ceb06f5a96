import os, sys, statistics, torch
from pathlib import Path
from gpuservd.config import EngineConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
d = Path.home() / ".local/share/gpuserv/models/smollm2"
torch.set_num_threads(2)
for sw in sys.argv[1:]:
    os.environ["GPUSERV_PANELS_Q4"] = sw
    eng = LLMEngine("smollm2", d, EngineConfig(model="smollm2", dtype="float32", num_threads=2))
    out = []
    for n in (1, 8, 48):
        eng.generate([[100 + i + j for i in range(32)] for j in range(n)], SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False))
        steps = eng.telemetry.recent(30)
        dec = [s.wall_s for s in steps if s.num_decode_tokens == n and s.num_prefill_tokens == 0]
        out.append(f"{n} rows {1e3*statistics.median(dec):.1f} ms")
    print(f"q4={sw}: " + ", ".join(out))
    del eng

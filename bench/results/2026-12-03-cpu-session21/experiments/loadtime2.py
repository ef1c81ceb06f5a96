"""SmolLM2 load time in the daemon's model manager: the first load at start, and a load again 6 s after an unload."""
import asyncio, sys, time
from gpuservd.api.metrics import Metrics
from gpuservd.serving.daemon_config import daemon_config_from_dict
from gpuservd.serving.serving import Serving
from gpuservd.serving.tenants import TenantMap

async def one(iso):
    m = Metrics()
    s = Serving(daemon_config_from_dict({"engine": {"isolation": iso, "num_threads": 2}, "server": {"models": []}}), TenantMap(), m)
    m.serving = s
    t = time.monotonic(); await s.load("smollm2"); first = time.monotonic() - t
    await s.unload("smollm2"); await asyncio.sleep(6)
    t = time.monotonic(); await s.load("smollm2"); again = time.monotonic() - t
    await s.stop_engines()
    return first, again

for iso in sys.argv[1:]:
    f, a = asyncio.run(one(iso))
    print(iso, f"first {f:.2f} s, again {a:.2f} s")

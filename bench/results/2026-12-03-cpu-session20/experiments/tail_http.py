import asyncio, json, sys, os, tempfile, threading, time, statistics
from pathlib import Path
import httpx
from gpuservd.bench.gpuserv_http import daemon_config, daemon_spec
from gpuservd.bench.server_process import ServerProcess
stream = os.environ.get("STREAM", "1") == "1"
cfg = daemon_config(Path("profiles/engine/peers-48.yaml"), 2, "bfloat16")
events = []
with tempfile.TemporaryDirectory() as tmp:
    spec = daemon_spec(Path(tmp), "smollm2", cfg)
    with ServerProcess(spec, Path(tmp) / "d.log") as srv:
        def reader():
            with httpx.Client(transport=httpx.HTTPTransport(uds=spec.uds), base_url="http://g", timeout=None) as c:
                with c.stream("GET", "/admin/events") as r:
                    for line in r.iter_lines():
                        if line: events.append(json.loads(line))
        if os.environ.get("EVENTS", "1") == "1": threading.Thread(target=reader, daemon=True).start()
        async def one(c, i, n):
            body = {"model": "smollm2", "prompt": [100 + (i * 7 + j) % 3000 for j in range(50)], "max_tokens": n,
                    "temperature": 0, "ignore_eos": True, "stream": stream}
            if stream:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines(): pass
            else:
                (await c.post("/v1/completions", json=body)).raise_for_status()
        async def run():
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=spec.uds), base_url="http://g", timeout=None) as c:
                await one(c, 99, 4)
                time.sleep(float(os.environ.get("SETTLE", "0")))
                t = time.time()
                await asyncio.gather(*[one(c, i, 400) for i in range(8)])
                return time.time() - t
        wall = asyncio.run(run())
        time.sleep(0.5)
st = [e for e in events if e.get("type") == "step" and e["num_decode_tokens"] == 8 and e["num_prefill_tokens"] == 0]
st = st[20:220] or [{"wall_s": wall/400, "forward_s": 0}]
print(f"stream={stream} wall {wall:.2f} n={len(st)} step wall {1e3*statistics.mean(e['wall_s'] for e in st):.2f} fwd {1e3*statistics.mean(e['forward_s'] for e in st):.2f}")

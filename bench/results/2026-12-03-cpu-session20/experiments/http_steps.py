"""Session 19's A/B of the critical lane through HTTP (lane-ab-http.txt), kept as it ran.

A private daemon (gpuserv bench's own daemon_spec, bf16, 2 threads) with its event stream read, one warm-up
request, an optional settle sleep (argv[1], seconds), then the mixed-short-long burst through the bench's
streaming client; prints throughput, the classes' latencies and the engine's step records grouped (steps
of at most 8 decode rows and no prefill: the long requests' tail).

    PYTHONPATH=$PWD .venv/bin/python bench/results/2026-12-03-cpu-session19/lane_ab_http.py 0 CONFIG.yaml

CONFIG: profiles/engine/peers-48.yaml (lane on), or the same with scheduler.critical_lane: false.
"""
import asyncio, json, sys, tempfile, threading, time, statistics
from pathlib import Path
import httpx
from gpuservd.bench.gpuserv_http import daemon_config, daemon_spec
from gpuservd.bench.server_process import ServerProcess
from gpuservd.bench.socket_run import gpuserv_endpoint
from gpuservd.bench.http_client import replay_async, warm_up
from gpuservd.bench.workload import load_workload
from transformers import AutoTokenizer

settle = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
cfgp = Path(sys.argv[2] if len(sys.argv) > 2 else "profiles/engine/peers-48.yaml")
wl = load_workload("profiles/workloads/mixed-short-long.yaml")
tok = AutoTokenizer.from_pretrained(str(Path.home() / ".local/share/gpuserv/models/smollm2"))
reqs = wl.materialize(len(tok), [tok.eos_token_id], tokenize=lambda s: tok.encode(s))
import os; cfg = daemon_config(cfgp, 2, os.environ.get("DT", "bfloat16"))
events = []
with tempfile.TemporaryDirectory() as tmp:
    spec = daemon_spec(Path(tmp), "smollm2", cfg)
    ep = gpuserv_endpoint("smollm2", spec.uds); ep.extra_body = {"return_token_ids": True}
    ep.per_request = lambda r: {"priority": r.priority}
    with ServerProcess(spec, Path(tmp) / "d.log") as srv:
        stop = False
        def reader():
            with httpx.Client(transport=httpx.HTTPTransport(uds=spec.uds), base_url="http://g", timeout=None) as c:
                with c.stream("GET", "/admin/events") as r:
                    for line in r.iter_lines():
                        if line:
                            events.append((time.time(), json.loads(line)))
        threading.Thread(target=reader, daemon=True).start()
        async def run():
            await warm_up(ep, list(reqs[0].prompt_token_ids[:16]))
            await asyncio.sleep(settle)
            rss = [l for l in open(f"/proc/{srv.pid}/status") if l.startswith("VmRSS")][0].split()[1]
            print("RSS at burst start MB", int(rss)//1024, "ready_s", srv.ready_s)
            import os as _os
            def snap():
                out={}
                for tid in _os.listdir(f"/proc/{srv.pid}/task"):
                    try:
                        st=open(f"/proc/{srv.pid}/task/{tid}/stat").read()
                        name=st[st.index('(')+1:st.rindex(')')]; f=st[st.rindex(')')+2:].split()
                        vc=[l for l in open(f"/proc/{srv.pid}/task/{tid}/status") if l.startswith("voluntary_ctxt")][0].split()[1]
                        out[tid]=(name,int(f[11])+int(f[12]),int(vc))
                    except OSError: pass
                return out
            snaps=[]
            def sampler():
                t0=time.time()
                while time.time()-t0<25:
                    snaps.append((time.time()-t0, snap(), _os.times())); time.sleep(0.5)
            threading.Thread(target=sampler,daemon=True).start()
            globals()['SNAPS']=snaps
            w0 = time.time()
            rep = await replay_async(ep, reqs)
            return w0, rep
        w0, rep = asyncio.run(run())
        time.sleep(0.5)
tokens = sum(t.output_tokens for t in rep.timings)
def p99(x):
    x=sorted(x); return x[min(len(x)-1, int(round(0.99*(len(x)-1))))]
sh=[t for t in rep.timings if t.cls=="short"]; lo=[t for t in rep.timings if t.cls=="long"]
print(f"settle {settle}: {tokens/rep.wall_s:.1f} tok/s wall {rep.wall_s:.2f}  short p50 {statistics.median(t.latency_s for t in sh):.2f} p99 {p99([t.latency_s for t in sh]):.2f}  long p99 {p99([t.latency_s for t in lo]):.2f}  ttft p50 {statistics.median(t.first_token_s for t in rep.timings):.2f}")
fin=[e for (_,e) in events if e.get("type")=="request_finished" and e.get("arrival_t") and e["arrival_t"]>=w0-0.01]
arr=sorted(e["arrival_t"]-w0 for e in fin)
print(f"server arrivals: n={len(arr)} first {arr[0]:.3f} median {arr[len(arr)//2]:.3f} last {arr[-1]:.3f}")
steps=[(t,e) for (t,e) in events if e.get("type")=="step" and t>=w0]
print("first steps (t since w0 at receipt, wall, prefill, decode, running, waiting):")
for t,e in steps[:14]:
    print(f"  {t-w0:6.3f} {e['wall_s']*1000:7.1f}ms fwd {e['forward_s']*1000:7.1f} p{e['num_prefill_tokens']:5d} d{e['num_decode_tokens']:3d} r{e['num_running']:3d} w{e['num_waiting']:3d}")
ws=[e['wall_s'] for _,e in steps]; bigf=[e['forward_s'] for _,e in steps if e['num_prefill_tokens']>0 or e['num_decode_tokens']>8]; tailf=[e['forward_s'] for _,e in steps if not(e['num_prefill_tokens']>0 or e['num_decode_tokens']>8)]; print(f"SPLIT fwd big n={len(bigf)} {sum(bigf):.2f} tail n={len(tailf)} {sum(tailf):.2f}"); print(f"SPLIT steps {len(steps)} sum wall {sum(ws):.2f} fwd {sum(e['forward_s'] for _,e in steps):.2f} sample {sum(e.get('sample_s',0) for _,e in steps):.2f} decide {sum(e.get('decision_s',0) for _,e in steps):.2f}"); print(f"steps {len(steps)}, sum wall {sum(ws):.2f} s, run wall {rep.wall_s:.2f}")
import collections
buckets=collections.OrderedDict()
for t,e in steps:
    k=int((t-w0)/0.5)
    b=buckets.setdefault(k,[0,0.0,0,0,0])
    b[0]+=1; b[1]+=e['wall_s']; b[2]+=e['num_prefill_tokens']; b[3]+=e['num_decode_tokens']; b[4]=e['num_running']
for k,b in buckets.items():
    print(f"  {k*0.5:5.1f}s steps {b[0]:3d} mean {1000*b[1]/b[0]:6.1f}ms prefill {b[2]:5d} decode rows {b[3]:5d} running(end) {b[4]}")
lt=[t for t in rep.timings if t.cls=="long"]
for t in sorted(lt,key=lambda t:t.finish_s): print(f"  long {t.request_id} out {t.output_tokens} first {t.first_token_s:.2f} done {t.finish_s:.2f}")
tail=[e['wall_s'] for _,e in steps if e['num_prefill_tokens']==0 and 0<e['num_decode_tokens']<=8]
t8=[e['wall_s'] for _,e in steps if e['num_prefill_tokens']==0 and e['num_decode_tokens']==8]
t1=[e['wall_s'] for _,e in steps if e['num_prefill_tokens']==0 and e['num_decode_tokens']==1]
sp=[e['wall_s'] for _,e in steps if e['num_decode_tokens']>8 or e['num_prefill_tokens']>0]
print(f"TAIL steps<=8 rows: n={len(tail)} sum {sum(tail):.2f}s mean {1000*statistics.mean(tail):.2f}ms | 8-row mean {1000*statistics.mean(t8):.2f} | 1-row mean {1000*statistics.mean(t1):.2f} | big steps n={len(sp)} sum {sum(sp):.2f}")

snaps=SNAPS
def delta(a,b):
    d={}
    for tid,(n,*c) in b[1].items():
        c0=a[1].get(tid,(n,0,0))
        if c[0]-c0[1]>0: d[f"{n}:{tid}"]=(c[0]-c0[1], c[1]-c0[2])
    return d
for i in range(0,len(snaps)-1,2):
    a,b=snaps[i],snaps[min(i+2,len(snaps)-1)]
    d=delta(a,b); cl=(b[2].user+b[2].system-a[2].user-a[2].system)
    print(f"{a[0]:5.1f}-{b[0]:5.1f}s", " ".join(f"{k}={v}" for k,v in sorted(d.items(),key=lambda x:-x[1][0])[:6]), f"client={cl:.2f}s")
import collections as _c
g=_c.defaultdict(list); gb=_c.defaultdict(list)
for t,e in steps:
    m=(e['step_id']//30)%2
    if e['num_prefill_tokens']==0 and e['num_decode_tokens']==8: g[m].append(e['forward_s'])
    if e['num_prefill_tokens']==0 and e['num_decode_tokens']>=24: gb[m].append(e['forward_s'])
for m in (0,1):
    if g[m]: print(f"ALT mode{m} 8-row n={len(g[m])} fwd mean {1e3*statistics.mean(g[m]):.2f} median {1e3*statistics.median(g[m]):.2f} | >=24-row n={len(gb[m])} mean {1e3*statistics.mean(gb[m]) if gb[m] else 0:.2f}")

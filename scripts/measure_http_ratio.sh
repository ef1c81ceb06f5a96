#!/usr/bin/env bash
# HTTP against in-process at 48 streams (README "gpuserv against the engines users would pick"): each workload
# runs once through `gpuserv bench --target http`, which runs gpuserv in-process and gpuserv[http] (a private
# daemon on its own socket, same config and threads, driven by the shared streaming client) REPEATS rounds
# interleaved and reports each system by its median-throughput round. Run it on a quiet machine.
#
# usage: [CONFIG=engine.yaml] [ISA=avx2] [PYTHON=...] scripts/measure_http_ratio.sh [OUT] [REPEATS=3] [WORKLOADS...]
#   CONFIG  default profiles/engine/peers-48.yaml (the device's default dtype, engine thread);
#           profiles/engine/peers-48-process.yaml puts the engine in a worker process,
#           profiles/engine/fp32-48.yaml with ISA=avx2 is the AVX2-only fp32 path
#   OUT     default bench/runs/<time>-http-ratio; WORKLOADS default: mixed-short-long burst-48x128
set -u
TREE=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$TREE/bench/runs/$(date +%Y%m%d-%H%M%S)-http-ratio}; REPEATS=${2:-3}; shift 2 2>/dev/null || shift $#
WORKLOADS=${*:-mixed-short-long burst-48x128}
PY=${PYTHON:-$TREE/.venv/bin/python}
C=${CONFIG:-profiles/engine/peers-48.yaml}
cd "$TREE" && export PYTHONPATH=$TREE
mkdir -p "$OUT"
for W in $WORKLOADS; do
    echo "== $W, $C${ISA:+, isa $ISA} ($(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg))"
    $PY -m gpuservd.cli.main bench -w profiles/workloads/$W.yaml -c "$C" --peers none --target http ${ISA:+--isa $ISA} \
        --repeats "$REPEATS" --out "$OUT/$W" > "$OUT/$W.log" 2>&1 || { echo "FAILED: see $OUT/$W.log"; continue; }
    $PY - "$OUT/$W/result.json" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
hi, s = d.get("http_inprocess") or {}, d["systems"]
h = s.get("gpuserv[http]", {}).get("extra", {})
print(f"  in-process {hi.get('inprocess_tok_s', 0):.1f} tok/s, http {hi.get('http_tok_s', 0):.1f} tok/s, "
      f"ratio {hi.get('throughput_ratio', 0):.3f} (target >= 0.95)")
print(f"  daemon CPU {h.get('server_cpu_ms_per_token')} ms/token, bench client CPU "
      f"{h.get('client_cpu_ms_per_token')} ms/token, outputs exact: {h.get('outputs_exact')}")
PYEOF
done

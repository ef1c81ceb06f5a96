#!/usr/bin/env bash
# serve22: issue 22's "HTTP/in-process throughput >= 0.95x at 48 streams", on a quiet machine.
# usage: [CONFIG=engine.yaml] [ISA=avx2] serve22-measure.sh [TREE=/work/main] [OUT=TREE/bench/runs/serve22] [REPEATS=3]
# Each workload runs once through `gpuserv bench --target http`: gpuserv in-process and gpuserv[http] (a private
# daemon on its own socket, same config and threads, driven by the shared streaming client), REPEATS rounds
# interleaved, each system reported by its median-throughput round.
set -u
TREE=${1:-/work/main}; OUT=${2:-$TREE/bench/runs/serve22}; REPEATS=${3:-3}
PY=/work/main/.venv/bin/python
cd "$TREE" && export PYTHONPATH=$TREE
mkdir -p "$OUT"
for W in mixed-short-long burst-48x128; do
    C=${CONFIG:-profiles/engine/peers-48.yaml}
    echo "== $W ($(date -u +%T))"
    $PY -m gpuservd.cli.main bench -w profiles/workloads/$W.yaml -c $C --peers none --target http ${ISA:+--isa $ISA} \
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

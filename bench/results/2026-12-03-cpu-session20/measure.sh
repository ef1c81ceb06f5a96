#!/usr/bin/env bash
# Session 20: the peers through HTTP with --repeats 5 (median round), the in-process engine's KV pool now
# committed before each burst as the idle daemon's is; bf16 then fp32 on the AVX2 kernels.
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-03-cpu-session20
mkdir -p $R
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
cp /work/wt/final20/measure.sh $R/; git rev-parse HEAD > $R/commit.txt
lscpu | grep -E "Model name|Flags" | cut -c1-2000 > $R/cpu.txt
log "1. peers through HTTP, bf16, mixed-short-long, 48 seqs, --repeats 5"; load
timeout 2400 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
    --peers llama_server,vllm_cpu --repeats 5 --out $R/peers-default-x5 > $R/peers-default-x5.log 2>&1; echo "rc $?" >> $R/measure.log
log "2. the same, fp32 on the AVX2 kernels, --repeats 5"; load
timeout 3000 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/fp32-48.yaml --isa avx2 \
    --peers llama_server,vllm_cpu --repeats 5 --out $R/peers-fp32-avx2-x5 > $R/peers-fp32-avx2-x5.log 2>&1; echo "rc $?" >> $R/measure.log
log "done"; load

#!/usr/bin/env bash
# Session 19: the peers through HTTP with --repeats 3 on main with the critical lane, bf16 then fp32 AVX2.
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-03-cpu-session19
mkdir -p $R
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
cp /work/wt/final19/measure.sh $R/; git rev-parse HEAD > $R/commit.txt
lscpu | grep -E "Model name|Flags" | cut -c1-2000 > $R/cpu.txt
log "1. peers through HTTP, bf16, mixed-short-long, 48 seqs, --repeats 3"; load
timeout 1800 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
    --peers llama_server,vllm_cpu --repeats 3 --out $R/peers-default-x3 > $R/peers-default-x3.log 2>&1; echo "rc $?" >> $R/measure.log
log "2. the same, fp32 on the AVX2 kernels, --repeats 3"; load
timeout 2400 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/fp32-48.yaml --isa avx2 \
    --peers llama_server,vllm_cpu --repeats 3 --out $R/peers-fp32-avx2-x3 > $R/peers-fp32-avx2-x3.log 2>&1; echo "rc $?" >> $R/measure.log
log "done"; load

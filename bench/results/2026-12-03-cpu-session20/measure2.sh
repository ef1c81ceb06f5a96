#!/usr/bin/env bash
# Session 20, second part: the same peers runs with the engine in a worker process (engine.isolation: process),
# after an alternated A/B showed the daemon 11-20% faster that way than with its engine in a thread.
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-03-cpu-session20
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
cp /work/wt/final20/measure2.sh $R/; git rev-parse HEAD > $R/commit2.txt
log "3. peers through HTTP, bf16, the engine in a worker process (peers-48-process.yaml), --repeats 3"; load
timeout 1500 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48-process.yaml \
    --peers llama_server,vllm_cpu --repeats 3 --out $R/peers-process-x3 > $R/peers-process-x3.log 2>&1; echo "rc $?" >> $R/measure.log
log "4. the same, fp32 on the AVX2 kernels (fp32-48-process.yaml), --repeats 3"; load
timeout 1800 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/fp32-48-process.yaml --isa avx2 \
    --peers llama_server,vllm_cpu --repeats 3 --out $R/peers-fp32-avx2-process-x3 > $R/peers-fp32-avx2-process-x3.log 2>&1; echo "rc $?" >> $R/measure.log
log "done"; load

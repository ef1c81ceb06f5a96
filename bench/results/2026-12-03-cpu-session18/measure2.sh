#!/usr/bin/env bash
# Session 18, second part: the peers runs again with --repeats 3 (every system three times, interleaved;
# each reported by its median-throughput round), on the quiet machine after the fresh-clone test run.
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-03-cpu-session18
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
cp /work/wt/final18/measure2.sh $R/; git rev-parse HEAD > $R/commit2.txt

log "5. peers through HTTP, bf16, mixed-short-long, 48 seqs, --repeats 3"; load
timeout 2400 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
    --peers llama_server,vllm_cpu --repeats 3 --out $R/peers-default-x3 > $R/peers-default-x3.log 2>&1; echo "rc $?" >> $R/measure.log

log "6. peers through HTTP, fp32 AVX2, --repeats 3"; load
timeout 2700 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/fp32-48.yaml \
    --peers llama_server,vllm_cpu --isa avx2 --repeats 3 --out $R/peers-fp32-avx2-x3 > $R/peers-fp32-avx2-x3.log 2>&1; echo "rc $?" >> $R/measure.log
log "done"; load

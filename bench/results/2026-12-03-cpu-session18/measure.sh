#!/usr/bin/env bash
# The quiet-machine measurements of session 18 (the same 2-core Zen 4 class EPYC with AVX-512 + avx512_bf16
# as sessions 14-17), in priority order. Output: bench/results/2026-12-03-cpu-session18/
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-03-cpu-session18; mkdir -p $R; RA=/work/main/$R
BASE=/work/wt/base18   # main as session 16 measured it (d63218f), before session 17's serving-path changes
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
lscpu | grep -E "Model name|Flags" | cut -c1-2000 > $R/cpu.txt; git rev-parse HEAD > $R/commit.txt
cp /work/wt/final18/measure.sh $R/

for run in a b; do
log "1$run. peers through HTTP, the default dtype here (bf16), mixed-short-long burst, 48 seqs"; load
timeout 1500 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
    --peers llama_server,vllm_cpu --out $R/peers-default-$run > $R/peers-default-$run.log 2>&1; echo "rc $?" >> $R/measure.log

log "2$run. peers through HTTP, fp32 with the AVX2 kernels (--isa avx2)"; load
timeout 1500 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/fp32-48.yaml \
    --peers llama_server,vllm_cpu --isa avx2 --out $R/peers-fp32-avx2-$run > $R/peers-fp32-avx2-$run.log 2>&1; echo "rc $?" >> $R/measure.log
done

log "3. HTTP vs in-process at 48 streams, 2 rounds, default dtype, engine thread: main, then session 16's main"; load
timeout 1200 bash scripts/measure_http_ratio.sh $RA/http-vs-inprocess 2 > $R/http-vs-inprocess.log 2>&1; echo "rc $?" >> $R/measure.log
(cd $BASE && PYTHONPATH=$BASE PYTHON=/work/main/.venv/bin/python timeout 1200 bash scripts/measure_http_ratio.sh $RA/http-vs-inprocess-base 2) > $R/http-vs-inprocess-base.log 2>&1; echo "rc $?" >> $R/measure.log

log "4. HTTP vs in-process at 48 streams, 2 rounds, fp32 + avx2, engine thread"; load
CONFIG=profiles/engine/fp32-48.yaml ISA=avx2 timeout 900 bash scripts/measure_http_ratio.sh $RA/http-vs-inprocess-fp32-avx2 2 > $R/http-vs-inprocess-fp32-avx2.log 2>&1; echo "rc $?" >> $R/measure.log

log "done"; load

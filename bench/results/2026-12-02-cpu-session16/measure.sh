#!/usr/bin/env bash
# The quiet-machine measurements of session 16 (the same 2-core Zen 4 class EPYC with AVX-512 + avx512_bf16
# as sessions 14-15), in priority order. Output: bench/results/2026-12-02-cpu-session16/
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-02-cpu-session16; mkdir -p $R; RA=/work/main/$R
BASE=/work/wt/base16   # main at the start of the session (8b389a1)
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
lscpu | grep -E "Model name|Flags" | cut -c1-2000 > $R/cpu.txt; git rev-parse HEAD > $R/commit.txt
cp /work/wt/final16/measure.sh $R/

log "1. peers through HTTP, the default dtype here (bf16), mixed-short-long burst, 48 seqs"; load
timeout 1500 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
    --peers llama_server,vllm_cpu --out $R/peers-default > $R/peers-default.log 2>&1; echo "rc $?" >> $R/measure.log

log "2. peers through HTTP, fp32 with the AVX2 kernels (--isa avx2)"; load
timeout 1500 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/fp32-48.yaml \
    --peers llama_server,vllm_cpu --isa avx2 --out $R/peers-fp32-avx2 > $R/peers-fp32-avx2.log 2>&1; echo "rc $?" >> $R/measure.log

log "3. HTTP vs in-process at 48 streams, 3 rounds, default dtype, engine thread: main, then the session's base"; load
timeout 1200 bash scripts/measure_http_ratio.sh $RA/http-vs-inprocess 3 > $R/http-vs-inprocess.log 2>&1; echo "rc $?" >> $R/measure.log
(cd $BASE && PYTHONPATH=$BASE PYTHON=/work/main/.venv/bin/python timeout 1200 bash scripts/measure_http_ratio.sh $RA/http-vs-inprocess-base 3) > $R/http-vs-inprocess-base.log 2>&1; echo "rc $?" >> $R/measure.log

log "4. HTTP vs in-process at 48 streams, 2 rounds, fp32 + avx2, engine thread"; load
CONFIG=profiles/engine/fp32-48.yaml ISA=avx2 timeout 900 bash scripts/measure_http_ratio.sh $RA/http-vs-inprocess-fp32-avx2 2 > $R/http-vs-inprocess-fp32-avx2.log 2>&1; echo "rc $?" >> $R/measure.log

log "done"; load

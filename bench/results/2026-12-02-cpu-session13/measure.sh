#!/usr/bin/env bash
# The quiet-machine measurements of session 13, in priority order. Output: bench/results/2026-12-02-cpu-session13/
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-02-cpu-session13; mkdir -p $R; RA=/work/main/$R
BASE=/work/wt/base13   # main at the start of the session (4e9db5d)
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
lscpu | grep -E "Model name|Flags" | cut -c1-400 > $R/cpu.txt; git rev-parse HEAD > $R/commit.txt
cp /work/wt/final13/measure.sh /work/wt/metrics20-measure.sh $R/

log "0. warm the base tree's kernels"; load
(cd $BASE && PYTHONPATH=$BASE timeout 300 /work/main/.venv/bin/python scripts/profile_decode_step.py --cases 1x32 --steps 2) > /tmp/base13-warm.log 2>&1

log "1. peers through HTTP (SmolLM2 fp32 = this AVX2 CPU's default dtype, mixed-short-long burst, 48 seqs)"; load
timeout 1200 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
    --peers llama_server,vllm_cpu --out $R/peers-default > $R/peers-default.log 2>&1; echo "rc $?" >> $R/measure.log

log "2. /metrics under 20 scrapes/s beside 4 streams on 2 models"; load
timeout 900 bash /work/wt/metrics20-measure.sh $RA/metrics ${METRICS_ROWS:-default default default} > $R/metrics.log 2>&1; echo "rc $?" >> $R/measure.log

log "3. step sections, base 4e9db5d / main alternated (8 x 480, 48 x 64)"; load
for t in base main base main; do d=$BASE; [ $t = main ] && d=/work/main; echo "== $t" >> $R/profile-ab.txt
  (cd $d && PYTHONPATH=$d timeout 300 /work/main/.venv/bin/python scripts/profile_decode_step.py --cases 8x480,48x64 --steps 20) >> $R/profile-ab.txt 2>&1; done

log "3b. packed fp32 before (4e9db5d) / after, quiet and beside one busy process; attention before/after"; load
timeout 300 $PY scripts/bench_packed_f32.py --out $RA/gemm-ab --threads 2 --no-steps --no-ceilings --variants packed \
    --rows 8,16,48 --reps 9 --baseline 4e9db5d > $R/gemm-ab.log 2>&1; echo "rc $?" >> $R/measure.log
timeout 300 $PY scripts/bench_packed_f32.py --out $RA/gemm-ab-busy --threads 2 --no-steps --no-ceilings --variants packed \
    --shapes qkv,o_proj,gate_up,down --rows 8,16,48 --reps 11 --baseline 4e9db5d --busy 1 > $R/gemm-ab-busy.log 2>&1; echo "rc $?" >> $R/measure.log
timeout 300 $PY scripts/bench_cpu_kernels.py --out $RA/attention-ab --attention-only --attention-cases 8x480,48x64 \
    --baseline 4e9db5d --reps 20 > $R/attention-ab.log 2>&1; echo "rc $?" >> $R/measure.log

log "4. HTTP vs in-process at 48 streams, 2 rounds"; load
timeout 900 bash /work/wt/serve22-measure.sh /work/main $RA/http-vs-inprocess 2 > $R/http-vs-inprocess.log 2>&1; echo "rc $?" >> $R/measure.log

log "done"; load

#!/usr/bin/env bash
# The quiet-machine measurements of session 11, in priority order. Output: bench/results/2026-12-02-cpu-session11/
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-02-cpu-session11; mkdir -p $R; RA=/work/main/$R
BASE=/work/wt/base11   # main at the start of the session (db90316)
[ -d $BASE ] || git worktree add --detach $BASE db90316 > /dev/null 2>&1
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
lscpu | grep -E "Model name|Flags" | cut -c1-400 > $R/cpu.txt; git rev-parse HEAD > $R/commit.txt
cp /work/wt/final11/measure.sh /work/wt/final11/steps.py /work/wt/serve22-measure.sh /work/wt/metrics20-measure.sh $R/

log "1. decode steps at 1/8/24/48 sequences (and 8 x ~480 tokens), base db90316 vs main, alternated"; load
mkdir -p $R/steps
for r in 1 2; do for tree in base main; do d=$BASE; [ $tree = main ] && d=/work/main
  (cd $d && PYTHONPATH=$d timeout 600 /work/main/.venv/bin/python $RA/steps.py $RA/steps/$tree-$r.json) > $RA/steps/$tree-$r.log 2>&1
done; done

log "1b. section profile of a decode step (attn8's script)"; load
timeout 300 $PY scripts/profile_decode_step.py --cases 8x480,1x480,8x32,1x32 > $R/profile-step.txt 2>&1; echo "rc $?" >> $R/measure.log

log "1c. packed fp32 per shape at 1-16 rows against the read floor (gemm8's bench), 2 threads"; load
timeout 400 $PY scripts/bench_packed_f32.py --out $RA/packed-f32-small --rows 1,4,8,16 --variants packed,packed_bf16 --no-steps --threads 2 > $R/packed-f32-small.log 2>&1; echo "rc $?" >> $R/measure.log

log "1d. paged_decode before (db90316) / after, per call"; load
timeout 400 $PY scripts/bench_cpu_kernels.py --attention-only --baseline db90316 --reps 10 --quick --out $RA/paged-decode > $R/paged-decode.log 2>&1; echo "rc $?" >> $R/measure.log

log "2. HTTP vs in-process at 48 streams, 3 rounds (serve22's script)"; load
timeout 1200 bash /work/wt/serve22-measure.sh /work/main $RA/http-vs-inprocess 3 > $R/http-vs-inprocess.log 2>&1; echo "rc $?" >> $R/measure.log

log "2b. the same through HTTP with the OpenMP workers at normal priority (GPUSERV_OMP_WORKER_PRIORITY=0), mixed-short-long, 2 rounds"; load
GPUSERV_OMP_WORKER_PRIORITY=0 timeout 600 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml --peers none --target http \
    --repeats 2 --out $RA/http-vs-inprocess-prio0 > $R/http-vs-inprocess-prio0.log 2>&1; echo "rc $?" >> $R/measure.log

log "2c. in-process mixed-short-long (peers-48 profile), base db90316 vs main"; load
mkdir -p $R/inprocess
for tree in base main; do d=$BASE; [ $tree = main ] && d=/work/main
  (cd $d && PYTHONPATH=$d timeout 400 /work/main/.venv/bin/python -m gpuservd.cli.main bench -w profiles/workloads/mixed-short-long.yaml \
     -c profiles/engine/peers-48.yaml --peers none --out $RA/inprocess/msl-$tree) > $RA/inprocess/msl-$tree.log 2>&1
done

log "3. peers through HTTP (SmolLM2 fp32 = this AVX2 CPU's default dtype, mixed-short-long burst, 48 seqs)"; load
timeout 1800 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
    --peers llama_server,vllm_cpu --out $R/peers-default > $R/peers-default.log 2>&1; echo "rc $?" >> $R/measure.log

log "4. /metrics under 20 scrapes/s beside 4 streams on 2 models (metrics20's script)"; load
timeout 900 bash /work/wt/metrics20-measure.sh $RA/metrics default-prio0 default default-nice10 default-prio0 default nosharing process > $R/metrics.log 2>&1; echo "rc $?" >> $R/measure.log

log "done"; load

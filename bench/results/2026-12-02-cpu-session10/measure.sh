#!/usr/bin/env bash
# The quiet-machine measurements of session 10, in priority order. Output: bench/results/2026-12-02-cpu-session10/
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-02-cpu-session10; mkdir -p $R; RA=/work/main/$R
BASE=/work/wt/base10   # main at the start of the session (47aca1a)
[ -d $BASE ] || git worktree add --detach $BASE 47aca1a > /dev/null 2>&1
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
lscpu | grep -E "Model name|Flags" | cut -c1-400 > $R/cpu.txt; git rev-parse HEAD > $R/commit.txt
cp /work/wt/final10/measure.sh /work/wt/final10/steps.py $R/

log "1. decode steps at 1/8/24/48 sequences (and 8 x ~500 tokens), base 47aca1a vs main, alternated"; load
mkdir -p $R/steps
for r in 1 2; do for tree in base main; do d=$BASE; [ $tree = main ] && d=/work/main
  (cd $d && PYTHONPATH=$d timeout 600 /work/main/.venv/bin/python $RA/steps.py $RA/steps/$tree-$r.json) > $RA/steps/$tree-$r.log 2>&1
done; done

log "1b. packed fp32 GEMM per shape and whole decode steps, packed vs dense (gemm22's bench)"; load
(cd scripts && PYTHONPATH=/work/main timeout 600 /work/main/.venv/bin/python bench_packed_f32.py --threads 2 --out $RA/packed-f32) > $R/packed-f32.log 2>&1; echo "rc $?" >> $R/measure.log

log "1c. paged_decode before (47aca1a) / after, per call (attn22's bench, --quick)"; load
timeout 400 $PY scripts/bench_cpu_kernels.py --attention-only --baseline 47aca1a --reps 10 --quick --out $RA/paged-decode > $R/paged-decode.log 2>&1; echo "rc $?" >> $R/measure.log

log "2. in-process mixed-short-long (peers-48 profile), base vs main; burst-48x128 main"; load
mkdir -p $R/inprocess
for tree in base main; do d=$BASE; [ $tree = main ] && d=/work/main
  (cd $d && PYTHONPATH=$d timeout 400 /work/main/.venv/bin/python -m gpuservd.cli.main bench -w profiles/workloads/mixed-short-long.yaml \
     -c profiles/engine/peers-48.yaml --peers none --out $RA/inprocess/msl-$tree) > $RA/inprocess/msl-$tree.log 2>&1
done

log "3. peers through HTTP (SmolLM2 fp32 = this AVX2 CPU's default dtype, mixed-short-long burst, 48 seqs)"; load
timeout 1800 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
    --peers llama_server,vllm_cpu --out $R/peers-default > $R/peers-default.log 2>&1; echo "rc $?" >> $R/measure.log

log "4. HTTP vs in-process at 48 streams (burst-48x128)"; load
timeout 900 bash /work/wt/MEASURE-stream22.sh /work/main $RA/stream > $R/stream.log 2>&1; echo "rc $?" >> $R/measure.log

log "5. /metrics under 20 scrapes/s beside 4 streams on 2 models (metrics20's script)"; load
timeout 900 bash /work/wt/MEASURE-metrics20.sh $RA/metrics > $R/metrics.log 2>&1; echo "rc $?" >> $R/measure.log

log "done"; load

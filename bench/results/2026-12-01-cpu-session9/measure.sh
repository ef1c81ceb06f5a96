#!/usr/bin/env bash
# The quiet-machine measurements of session 9, in priority order. Output: bench/results/2026-12-01-cpu-session9/
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-01-cpu-session9; mkdir -p $R; RA=/work/main/$R
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
lscpu | grep -E "Model name|Flags" | cut -c1-400 > $R/cpu.txt
cp /work/wt/final9/measure.sh /work/wt/final9/raw_scrape_client.py $R/

log "0. the renovation's before/after: base 7b30d73 vs main, burst-32x64 3x interleaved, mixed-short-long 1x, greedy tokens"; load
[ -d /work/wt/base16 ] || git worktree add --detach /work/wt/base16 7b30d73 > /dev/null 2>&1
ab() {  # workload tag
  for tree in base main; do d=/work/wt/base16; [ $tree = main ] && d=/work/main
    (cd $d && PYTHONPATH=$d timeout 400 /work/main/.venv/bin/python -m gpuservd.cli.main bench --workload profiles/workloads/$1.yaml \
      --peers none --out $RA/renovation/$2-$tree) > $RA/renovation/$2-$tree.log 2>&1
  done
}
mkdir -p $R/renovation
ab burst-32x64 burst1; ab burst-32x64 burst2; ab burst-32x64 burst3; ab mixed-short-long msl
cp bench/results/2026-12-01-cpu-session7/tokens_check.py /work/wt/tokens_check.py
for tree in base main; do d=/work/wt/base16; [ $tree = main ] && d=/work/main
  (cd $d && PYTHONPATH=$d timeout 300 /work/main/.venv/bin/python /work/wt/tokens_check.py profiles/workloads/mixed-short-long.yaml) > $RA/renovation/tokens-$tree.log 2>&1; done
log "1. HTTP vs in-process at 48 streams (burst-48x128), /metrics under scrapes (SmolLM2 + LoRA, 4 streams)"; load
timeout 900 bash /work/wt/MEASURE-stream22.sh /work/main $PWD/$R/stream > $R/stream.log 2>&1; echo "rc $?" >> $R/measure.log
log "2. peers through HTTP (SmolLM2 fp32 = this AVX2 CPU's default dtype, mixed-short-long burst, 48 seqs)"; load
timeout 1800 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
    --peers llama_server,vllm_cpu --out $R/peers-default > $R/peers-default.log 2>&1; echo "rc $?" >> $R/measure.log
log "3. /metrics with a raw keep-alive client (no httpx): idle daemon, then beside 4 streams"; load
RUN=$(mktemp -d /tmp/m9.XXXX); chmod 700 $RUN; SOCK=$RUN/gs.sock
$G serve --socket $SOCK -m smollm2 -m smollm2-lora > $R/raw-scrape-daemon.log 2>&1 & D=$!
for i in $(seq 180); do curl -s --unix-socket $SOCK http://x/ready 2>/dev/null | grep -q '"ready":true' && break; sleep 1; done
sleep 15
{ echo "idle, 10 ms apart:"; $PY $R/raw_scrape_client.py $SOCK 300 0.01
  echo "idle, back to back:"; $PY $R/raw_scrape_client.py $SOCK 300 0
  $PY scripts/bench_metrics_scrape.py --socket $SOCK --models smollm2,smollm2-lora --rate 20 --seconds 30 --clients 4 > $R/raw-scrape-httpx.json 2>&1 & S=$!
  sleep 6; echo "beside 4 streams (and the httpx scraper at 20/s), 50 ms apart:"; $PY $R/raw_scrape_client.py $SOCK 400 0.05; wait $S
} > $R/raw-scrape.txt 2>&1
kill -TERM $D; wait $D; rm -rf $RUN
log "done"; load

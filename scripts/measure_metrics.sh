#!/usr/bin/env bash
# /metrics latency under load (README "/metrics"): a daemon serving two models, 20 scrapes/s from a plain
# keep-alive socket client beside 4 streams (scripts/bench_metrics_scrape.py), one 30 s row per setting, the
# OpenMP pool workers' priority (GPUSERV_OMP_WORKER_PRIORITY) as the main switch: unset is the daemon's default
# (the workers keep the engine's priority), idle lowers them to SCHED_IDLE, a number 1-19 is a nice value.
# Needs SmolLM2 in the store (`make model`) and its LoRA variant smollm2-lora for the default rows:
#   gpuserv models make-adapter --base smollm2 --out /tmp/lora-adapter --kind lora
#   gpuserv models derive smollm2-lora --base smollm2 --adapter /tmp/lora-adapter
# usage: scripts/measure_metrics.sh [OUT] [ROWS...]   (~1.3 min a row; SECS, IDLE, SETTLE, XENV, PYTHON in the env)
# ROWS (default: default default-idle): default-prio0 default default-nice10 default-idle nosharing-prio0
#   nosharing process-prio0 process noahead
set -u
TREE=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$TREE/bench/runs/$(date +%Y%m%d-%H%M%S)-metrics}; shift || true; mkdir -p "$OUT"
ROWS=${*:-default default-idle}
PY=${PYTHON:-$TREE/.venv/bin/python}
CFG=$(mktemp -d /tmp/m20cfg.XXXX)
printf 'sharing:\n  enabled: false\n' > $CFG/nosharing.yaml
printf 'engine:\n  isolation: process\n' > $CFG/process.yaml
printf 'server:\n  metrics_max_age_ms: 0\n' > $CFG/noahead.yaml
# a private store with SmolLM2 twice (symlinks): two full models for engine worker processes (a variant cannot
# run in one yet)
H=$CFG/home/models; S=${GPUSERV_HOME:-$HOME/.local/share/gpuserv}/models/smollm2; mkdir -p $H/smollm2 $H/smollm2b
for f in $S/*; do ln -s $f $H/smollm2/; ln -s $f $H/smollm2b/; done
rm $H/smollm2b/gpuserv.yaml; sed 's/^name: smollm2$/name: smollm2b/' $S/gpuserv.yaml > $H/smollm2b/gpuserv.yaml

# run LABEL PRIORITY MODELS [CONFIG] (PRIORITY '': the daemon's default; $XENV: more K=V for the daemon): daemon, ready, settle, bench_metrics_scrape (raw scraper, 4 streams on both models)
run() {
  local label=$1 prio=$2 models=$3 cfg=${4:-}
  local run=$(mktemp -d /tmp/m20r.XXXX); chmod 700 $run; local sock=$run/gs.sock
  (cd $TREE && exec env ${prio:+GPUSERV_OMP_WORKER_PRIORITY=$prio} ${XENV:-} PYTHONPATH=$TREE $PY -m gpuservd.cli.main serve --socket $sock \
      ${cfg:+-c $cfg} $(echo $models | tr , '\n' | sed 's/^/-m /')) > "$OUT/$label.daemon.log" 2>&1 & local d=$!
  for i in $(seq 180); do curl -s --unix-socket $sock http://x/ready 2>/dev/null | grep -q '"ready":true' && break; sleep 1; done
  sleep ${SETTLE:-10}  # past the host-tier copy after a load
  (cd $TREE && PYTHONPATH=$TREE $PY $TREE/scripts/bench_metrics_scrape.py --socket $sock --models $models \
      --rate 20 --seconds ${SECS:-30} --clients 4 --idle-scrapes ${IDLE:-200}) > "$OUT/$label.json" 2> "$OUT/$label.err"
  kill -TERM $d; wait $d; rm -rf $run
  $PY - "$OUT/$label.json" "$label" <<'PYEOF' | tee -a "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1])); d = r.get("decomposition", {}).get("slowest5pct", {})
print(f"{sys.argv[2]:18s} p50 {r['p50_ms']:6.2f}  p99 {r['p99_ms']:6.2f}  health_p99 {r['health_p99_ms']:6.2f}  "
      f"tok/s {r['tokens_per_s_meanwhile']:6.1f}  idle_cpu {r.get('idle_metrics_loop_cpu_ms', '-')}  "
      f"ahead {r.get('rendered_ahead_share', '-')}  | slowest 5%: "
      + "  ".join(f"{k.removesuffix('_ms')} {v}" for k, v in d.items()))
PYEOF
}
for row in $ROWS; do
  case $row in
    default-prio0)   run $row 0  smollm2,smollm2-lora ;;
    default)         run $row '' smollm2,smollm2-lora ;;
    default-nice10)  run $row 10 smollm2,smollm2-lora ;;
    default-idle)    run $row idle smollm2,smollm2-lora ;;
    nosharing-prio0) run $row 0  smollm2,smollm2-lora $CFG/nosharing.yaml ;;
    nosharing)       run $row '' smollm2,smollm2-lora $CFG/nosharing.yaml ;;
    process-prio0)   GPUSERV_HOME=$CFG/home run $row 0  smollm2,smollm2b $CFG/process.yaml ;;
    process)         GPUSERV_HOME=$CFG/home run $row '' smollm2,smollm2b $CFG/process.yaml ;;
    # metrics9: /metrics rendered at every scrape (server.metrics_max_age_ms: 0), i.e. before the render-ahead
    noahead)         run $row '' smollm2,smollm2-lora $CFG/noahead.yaml ;;
    *) echo "unknown row $row" >&2 ;;
  esac
done
rm -rf $CFG

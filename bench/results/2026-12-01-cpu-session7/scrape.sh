#!/usr/bin/env bash
# /metrics under 20 scrapes/s on a daemon serving SmolLM2 and a LoRA variant of it.
set -x
cd /work/main
PY=".venv/bin/python"; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-01-cpu-session7
export PYTHONPATH=$PWD
$G models ls | grep -q smollm2-lora || { $G models make-adapter --base smollm2 --out /tmp/scrape-adapter --kind lora && $G models derive smollm2-lora --base smollm2 --adapter /tmp/scrape-adapter; }
mkdir -p /tmp/scrape; chmod 700 /tmp/scrape
$G serve --socket /tmp/scrape/gs.sock -m smollm2 -m smollm2-lora > /tmp/scrape/daemon.log 2>&1 &
D=$!
for i in $(seq 60); do [ -S /tmp/scrape/gs.sock ] && curl -s --unix-socket /tmp/scrape/gs.sock http://x/ready | grep -q . && break; sleep 1; done
sleep 3
timeout 120 $PY scripts/bench_metrics_scrape.py --socket /tmp/scrape/gs.sock --models smollm2,smollm2-lora --rate 20 --seconds 20 --clients 4 --out $R/metrics-scrape > $R/metrics-scrape.log 2>&1
kill -INT $D; wait $D

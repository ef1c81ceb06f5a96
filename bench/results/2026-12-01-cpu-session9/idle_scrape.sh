#!/usr/bin/env bash
# /metrics and /health round trips on an idle daemon (SmolLM2 + LoRA), raw keep-alive client, after the
# daemon's own start-up work (host-tier copies) has finished: its CPU time stops growing for 5 s.
set -u
cd /work/main; export PYTHONPATH=$PWD; PY=.venv/bin/python
R=bench/results/2026-12-01-cpu-session9
RUN=$(mktemp -d /tmp/m9i.XXXX); chmod 700 $RUN; SOCK=$RUN/gs.sock
$PY -m gpuservd.cli.main serve --socket $SOCK -m smollm2 -m smollm2-lora > $R/idle-scrape-daemon.log 2>&1 & D=$!
for i in $(seq 180); do curl -s --unix-socket $SOCK http://x/ready 2>/dev/null | grep -q '"ready":true' && break; sleep 1; done
cpu() { awk '{print $14+$15}' /proc/$D/stat; }
prev=$(cpu); for i in $(seq 60); do sleep 5; now=$(cpu); [ $((now - prev)) -lt 20 ] && break; prev=$now; done
echo "settled after $((i*5)) s (daemon CPU ticks in the last 5 s: $((now - prev)))"
for r in 1 2 3; do echo "idle, 10 ms apart, run $r:"; $PY $R/raw_scrape_client.py $SOCK 300 0.01; done
echo "idle, back to back:"; $PY $R/raw_scrape_client.py $SOCK 300 0
kill -TERM $D; wait $D; rm -rf $RUN

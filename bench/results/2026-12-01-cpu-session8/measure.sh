#!/usr/bin/env bash
# The quiet-machine measurements of session 8, in priority order. Output: bench/results/2026-12-01-cpu-session8/
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-01-cpu-session8; mkdir -p $R
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
lscpu | grep -E "Model name|Flags" | sed 's/Flags:.*/&/' | cut -c1-200 > $R/cpu.txt

log "1. peers through HTTP (fp32, mixed-short-long burst)"; load
timeout 1500 $G bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/fp32-48.yaml \
    --peers llama_server,vllm_cpu --isa avx2 --out $R/peers-fp32 > $R/peers-fp32.log 2>&1; echo "rc $?" >> $R/measure.log
log "2. srf vs fcfs (in-process)"; load
timeout 900 $G bench -w profiles/workloads/mixed-short-long.yaml --config profiles/scheduler/srf.yaml \
    --compare profiles/scheduler/fcfs.yaml --peers none --out $R/srf-vs-fcfs > $R/srf-vs-fcfs.log 2>&1; echo "rc $?" >> $R/measure.log
log "3. structured output cost at batch 32"; load
timeout 600 $PY scripts/bench_structured.py --batch 32 --out $R/structured > $R/structured.log 2>&1; echo "rc $?" >> $R/measure.log
log "4. cold start (pipeline) + INT8 agreement"; load
timeout 900 $G bench cold-start --model smollm2 --repeats 3 --threads 2 --dtype float32 --out $R/cold-start > $R/cold-start.log 2>&1; echo "rc $?" >> $R/measure.log
log "5. HTTP vs in-process at 48 streams, /metrics under scrapes"; load
timeout 900 bash /work/wt/MEASURE-stream22.sh /work/main $PWD/$R/stream > $R/stream.log 2>&1; echo "rc $?" >> $R/measure.log
log "6. the floor, 5 runs"; load
for i in 1 2 3 4 5; do
  timeout 300 $G bench --workload profiles/workloads/smoke.yaml --peers none --out /tmp/floor5/run$i > /tmp/floor5-log$i.txt 2>&1
  $PY -c "import json; f=json.load(open('/tmp/floor5/run$i/result.json'))['floor']; print($i, f['probe_readings_gbs'], round(f['floor_step_ms'],1), round(f['gpuserv_batch1_step_ms'],1), f['ratio'], f['probe_wrong'])" >> $R/floor-5-runs.txt 2>&1
done
log "done"; load

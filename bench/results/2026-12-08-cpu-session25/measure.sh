#!/usr/bin/env bash
# Session 25 (a 2-core AMD EPYC Zen 4 with AVX-512 and AVX512_BF16: bf16 is its default dtype; ISA=avx2 CONFIG=profiles/engine/fp32-48.yaml gives the fp32 row held to the AVX2 kernels): the peers through
# HTTP with --repeats 3 (median round), the daemon at its defaults (engine.isolation auto: a worker process).
set -u
cd /work/main
export PYTHONPATH=$PWD
PY=.venv/bin/python; G="$PY -m gpuservd.cli.main"
R=bench/results/2026-12-08-cpu-session25
N=${N:-3}; OUTN=${OUTN:-peers-default-x$N}
log() { echo "== $(date +%T) $*" | tee -a $R/measure.log; }
load() { echo "   load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $R/measure.log; }
git rev-parse HEAD > $R/commit-$OUTN.txt
lscpu | grep -E "Model name|Flags" | cut -c1-2000 > $R/cpu.txt
log "peers through HTTP, ${CONFIG:-peers-48} ${ISA:-native}, mixed-short-long, 48 seqs, --repeats $N -> $OUTN"; load
timeout 3000 $G bench -w profiles/workloads/mixed-short-long.yaml -c ${CONFIG:-profiles/engine/peers-48.yaml} \
    --peers llama_server,vllm_cpu ${ISA:+--isa $ISA} --repeats $N --out $R/$OUTN > $R/$OUTN.log 2>&1; echo "rc $?" >> $R/measure.log
log "done"; load

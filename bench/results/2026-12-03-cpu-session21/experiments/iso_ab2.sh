#!/usr/bin/env bash
# Alternated A/B through a private daemon (burst_http.py): the engine in a thread against the default,
# engine.isolation: auto (a worker process for the CPU model). fp32, this CPU's default dtype.
cd /work/main
D=bench/results/2026-12-03-cpu-session21/experiments
for i in 1 2 3; do
  echo "auto   $(PYTHONPATH=/work/main timeout 400 .venv/bin/python $D/burst_http.py profiles/engine/fp32-48.yaml 2>&1 | tail -1)"
  echo "thread $(PYTHONPATH=/work/main timeout 400 .venv/bin/python $D/burst_http.py profiles/engine/fp32-48-thread.yaml 2>&1 | tail -1)"
done

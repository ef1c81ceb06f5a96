#!/usr/bin/env bash
# The mixed burst through a private daemon, the worker's post hold 0 / 50 ms alternated.
cd /work/main
for i in 1 2 3; do
  for h in 0 50; do
    echo "hold ${h} ms: $(GPUSERV_EXP_HOLD_MS=$h PYTHONPATH=/work/main .venv/bin/python /tmp/exp/burst_http.py profiles/engine/peers-48.yaml float32 2>&1 | tail -1)"
  done
done

cd /work/wt/s20
for i in 1 2 3; do
  echo "hold0  $(GPUSERV_STREAM_HOLD_MS=0 EVENTS=0 STREAM=1 PYTHONPATH=/work/wt/s20 timeout 200 /work/main/.venv/bin/python /tmp/s20/tail_http.py)"
  echo "hold50 $(EVENTS=0 STREAM=1 PYTHONPATH=/work/wt/s20 timeout 200 /work/main/.venv/bin/python /tmp/s20/tail_http.py)"
done

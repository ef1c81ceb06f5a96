cd /work/wt/s20
for i in 1 2 3; do
  echo "hold0  $(PYTHONPATH=/work/wt/s20 timeout 300 /work/main/.venv/bin/python /tmp/s20/burst_http.py profiles/engine/peers-48.yaml 2>&1 | tail -1)"
  echo "hold50 $(XHOLD_MS=50 PYTHONPATH=/work/wt/s20 timeout 300 /work/main/.venv/bin/python /tmp/s20/burst_http.py profiles/engine/peers-48.yaml 2>&1 | tail -1)"
done

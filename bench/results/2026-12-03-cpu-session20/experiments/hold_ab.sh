cd /work/wt/s20
for i in 1 2 3; do
  echo "hold0  $(EVENTS=0 STREAM=1 PYTHONPATH=/work/wt/s20 timeout 200 /work/main/.venv/bin/python /tmp/s20/tail_http.py)"
  echo "hold50 $(XHOLD_MS=50 EVENTS=0 STREAM=1 PYTHONPATH=/work/wt/s20 timeout 200 /work/main/.venv/bin/python /tmp/s20/tail_http.py)"
  echo "nostr  $(EVENTS=0 STREAM=0 PYTHONPATH=/work/wt/s20 timeout 200 /work/main/.venv/bin/python /tmp/s20/tail_http.py)"
done

cd /work/main
for i in 1 2 3; do
  echo "thread  $(PYTHONPATH=/work/main timeout 300 .venv/bin/python /tmp/s20/burst_http.py profiles/engine/peers-48.yaml 2>&1 | tail -1)"
  echo "process $(PYTHONPATH=/work/main timeout 300 .venv/bin/python /tmp/s20/burst_http.py profiles/engine/peers-48-process.yaml 2>&1 | tail -1)"
done

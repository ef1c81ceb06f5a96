cd /work/main
for i in 1 2 3; do
  echo "inproc  $(NSTEPS=380 PYTHONPATH=$PWD .venv/bin/python /tmp/s20/tail.py)"
  echo "d-nostr $(EVENTS=0 STREAM=0 PYTHONPATH=$PWD timeout 200 .venv/bin/python /tmp/s20/tail_http.py)"
  echo "d-str   $(EVENTS=0 STREAM=1 PYTHONPATH=$PWD timeout 200 .venv/bin/python /tmp/s20/tail_http.py)"
done

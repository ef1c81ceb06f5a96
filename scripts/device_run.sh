#!/usr/bin/env bash
# One call on a lent GPU machine (the `device` tool): what this project checks and measures there.
#
#   scripts/device_run.sh PART... [-- BUDGET_S]     parts: env tests swap cold cold-seq check daemon fast
#
#   env    nvidia-smi, python, torch / CUDA versions
#   tests  pytest tests/test_cuda.py (the engine on CUDA: tokens against the CPU, asynchronous swap,
#          layered loading through pinned buffers, INT8 expanded on the GPU)
#   swap   scripts/bench_swap_overlap.py (issue 3: a swap-out's host copy beside the next step)
#   swap-16k  the same with a 16k-token victim and a 64-sequence step
#   cold   the pipelined load's tests on CUDA, then gpuserv bench cold-start on cuda:0, bf16, SmolLM2's
#          shape with random weights (TTFT next to the read floor of the bytes read)
#   cold-seq  the same bench with GPUSERV_LOAD_PIPELINE=0 (no reader thread: the A/B reference)
#   cold-1b   the same for TinyLlama-1.1B's shape (2.2 GB of bf16 on disk)
#   daemon    gpuserv serve on cuda:0 (bf16, SmolLM2's shape): one request through the socket, status,
#             doctor and /metrics, then Ctrl-C (DEVICE=cpu tries the part here)
#   check  scripts/gpu_check.py (issue 8: readings, green contexts, MPS, the isolation bench), with
#          what is left of BUDGET_S (default 520 s for the whole call)
#   fast   issue 19 in one call of at most 7 minutes (`fast -- 420`): versions; each Triton kernel
#          against torch and the CUDA engine tests (graphs included); the decode fast-path bench
#          (python3 -m gpuservd.bench.fast_decode: step times eager / fixed-shape / graph / graph with
#          every row sampled on the device / static ceiling / read floor for SmolLM2's and a ~1B shape,
#          a mixed step both ways, greedy graph == eager and == graph with overlap, seeded sampling
#          graph == fixed-shape eager, 256 random-length requests eager, with graphs, and with graphs
#          and overlap); then the rest of the test suite with the time left.
#          Everything in bench/results/<date>-h200-fast/
#
# The machine has no network: the Python packages its image lacks (starlette, uvicorn, gguf, textual,
# and for the full test suite openai, import-linter, pytest-textual-snapshot and theirs) travel as
# wheels in .whl (git-ignored; carry it), fetched here by scripts/device_wheels.sh. Everything lands in
# bench/results/<date>-h200-*/ and, as results.tgz plus run.log, under $OUT.
set -u
PARTS=()
BUDGET=520
while [ $# -gt 0 ]; do
  case "$1" in
    --) BUDGET="$2"; shift 2 ;;
    *) PARTS+=("$1"); shift ;;
  esac
done
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
OUT="${OUT:-/tmp/device-out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1 GPUSERV_HOME=/tmp/gpuserv-home
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
DAY=$(date +%Y-%m-%d)
RES=bench/results
touch /tmp/device-run-start
pack() { find "$RES" -newer /tmp/device-run-start -type f | tar czf "$OUT/results.tgz" -T - 2>/dev/null; }
for part in "${PARTS[@]}"; do
  echo "=== $part ($(left) s left) $(date +%T)"
  case "$part" in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
      python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
      df -h /tmp | tail -1; nproc ;;
    tests)
      mkdir -p "$RES/$DAY-h200-cuda-tests"
      timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py -rA \
        2>&1 | tee "$RES/$DAY-h200-cuda-tests/pytest.log" | tail -40 ;;
    swap)
      timeout 120 python3 scripts/bench_swap_overlap.py --out "$RES/$DAY-h200-swap-overlap" ;;
    swap-16k)
      timeout 120 python3 scripts/bench_swap_overlap.py --batch 64 --victim-tokens 16384 \
        --out "$RES/$DAY-h200-swap-overlap-16k" ;;
    cold)
      # the pipelined load on the GPU first (pinned reads, side-stream copies, INT8 expanded there: the
      # device weights bit-identical to the sequential path's), then the bench: each strategy's TTFT next
      # to the read floor of the bytes it read (TTFT / floor), the warm TTFT, and whether the cache dropped
      mkdir -p "$RES/$DAY-h200-cold-start"
      timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_load_pipeline.py \
        tests/test_cuda.py::test_layered_load_gives_the_full_loads_tokens \
        tests/test_cuda.py::test_int8_weights_are_expanded_on_the_device -rs \
        2>&1 | tee "$RES/$DAY-h200-cold-start/pytest.log" | tail -8
      timeout 200 python3 -m gpuservd.cli.main bench cold-start --model isolation-small --device cuda:0 \
        --dtype bfloat16 --repeats 3 --out "$RES/$DAY-h200-cold-start" ;;
    cold-seq)
      # the same bench without the reader thread (GPUSERV_LOAD_PIPELINE=0): the A/B reference
      GPUSERV_LOAD_PIPELINE=0 timeout 200 python3 -m gpuservd.cli.main bench cold-start --model isolation-small \
        --device cuda:0 --dtype bfloat16 --repeats 3 --out "$RES/$DAY-h200-cold-start-sequential" ;;
    cold-1b)
      timeout 240 python3 -m gpuservd.cli.main bench cold-start --model cold-1b --device cuda:0 \
        --dtype bfloat16 --repeats 3 --out "$RES/$DAY-h200-cold-start-1b" ;;
    daemon)
      # The daemon on the GPU end to end: a model on cuda, one request through the socket (streamed by
      # --demo), status, doctor and metrics over the socket, then Ctrl-C (drain and stop).
      D="$RES/$DAY-h200-daemon"; mkdir -p "$D"
      python3 -c "from gpuservd.bench.random_model import RANDOM_MODELS, ensure_random_llama as e; \
from gpuservd.store.store import ModelStore; e(ModelStore(), 'isolation-small', RANDOM_MODELS['isolation-small'], 'smollm2')"
      printf 'engine: {device: %s, dtype: bfloat16}\n' "${DEVICE:-cuda:0}" > /tmp/gpuserv-device.yaml
      export GPUSERV_SOCKET=/tmp/gpuserv-device/gpuserv.sock
      python3 -m gpuservd.cli.main serve -c /tmp/gpuserv-device.yaml -m isolation-small \
        --demo "Say hello." > "$D/serve.log" 2>&1 &
      SERVE=$!
      for _ in $(seq 90); do grep -q "^demo: .* served" "$D/serve.log" && break; sleep 1; done
      python3 -m gpuservd.cli.main status > "$D/status.txt" 2>&1
      python3 -m gpuservd.cli.main doctor > "$D/doctor.txt" 2>&1
      python3 -c "from gpuservd.api.client import Client; print(Client().metrics())" \
        > "$D/metrics.txt" 2>&1 || true
      kill -INT $SERVE; wait $SERVE; echo "serve exit: $?" >> "$D/serve.log"
      unset GPUSERV_SOCKET
      tail -5 "$D/serve.log"; head -30 "$D/status.txt"; tail -15 "$D/doctor.txt" ;;
    check)
      B=$(( $(left) - 15 ))
      [ "$B" -gt 60 ] && timeout $(( B + 30 )) python3 scripts/gpu_check.py --budget-s "$B" || echo "check: skipped or failed ($B s)" ;;
    fast)
      D="$RES/$DAY-h200-fast"; mkdir -p "$D"
      { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
        python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, \
triton.__version__, torch.cuda.get_device_name(0))"; } 2>&1 | tee "$D/versions.txt"
      # 1. Correctness on the GPU: each Triton kernel against torch, the engine's CUDA paths and graphs.
      timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfE tests/test_triton_kernels.py \
        tests/test_cuda.py 2>&1 | tee "$D/pytest-gpu.log" | tail -8
      pack
      # 2. The numbers (leaves the suite at least ~120 s).
      B=$(( $(left) - 120 ))
      timeout $(( B > 60 ? B : 60 )) python3 -m gpuservd.bench.fast_decode --out "$D" --budget-s $(( B > 90 ? B - 40 : 50 )) \
        2>&1 | tee "$D/bench.log" | tail -25
      pack
      # 3. The rest of the suite, on 8 workers where pytest-xdist is there (it is in the image; files stay
      # whole on one worker), so it fits the call.
      XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 8 --dist loadfile"
      timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfE $XD tests \
        --ignore=tests/test_triton_kernels.py --ignore=tests/test_cuda.py 2>&1 | tee "$D/pytest.log" | tail -25 ;;
    *) echo "unknown part $part" ;;
  esac
  pack  # after each part: a call cut off at its limit still brings back what finished
done
echo "=== done in $(( $(date +%s) - T0 )) s"; tar tzf "$OUT/results.tgz" | head -40

#!/usr/bin/env bash
# Builds the paged_decode harness: the prefetching fp32 item as of 4e9db5d ("cur"), the tree's
# attention_f32.h ("new") and the read-order probes ("read", READMODE=0..7), SmolLM2 shape, 30 per-layer
# caches of NB scattered 16-token blocks.
#   ./h B CTX REPS     (env: OMP_NUM_THREADS, CPUT=1, LAYERS, NB, FN=cur,new,read, READMODE, ITEM=N)
set -e
cd "$(dirname "$0")"
ROOT=../../../..
git -C $ROOT show 4e9db5d:gpuservd/runner/csrc/paged_attention.cpp | sed -n '/^namespace {$/,/^ItemFn<T> pick_item_fn/p' | sed '1d;$d' | sed '$d' > body.inc
TI=$(${PY:-$ROOT/.venv/bin/python} -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])")
g++ -O3 -std=c++20 -fopenmp -mavx2 -mfma -mf16c -I"$TI" -I$ROOT/gpuservd/runner/csrc h.cpp -o h

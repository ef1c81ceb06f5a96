#!/usr/bin/env bash
# Builds the paged_decode harness from the tree's kernel (paged_attention.cpp's item functions, fp32 path,
# SmolLM2 shape: 9 heads, 3 KV heads, head dim 64, 16-token blocks, 30 per-layer caches of NB blocks).
#   ./h B CTX HUGE REPS    (env: OMP_NUM_THREADS, FN=cur|read|new, LAYERS, NB, CPUT=1 for process CPU time)
# cur = the kernel as in the tree; read = only the loads of the same K/V rows in the same order and work
# split (the floor of this access pattern); new = v_new.inc (4 tokens per K step, 32-token chunks across
# blocks, row prefetch), which did not pay (see ../README.md).
set -e
cd "$(dirname "$0")"
ROOT=../../../..
sed -n '/^namespace {$/,/^ItemFn<T> pick_item_fn/p' $ROOT/gpuservd/runner/csrc/paged_attention.cpp | sed '1d;$d' | sed '$d' > body.inc
cp $ROOT/gpuservd/runner/csrc/simd.h .
TI=$(${PY:-$ROOT/.venv/bin/python} -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])")
g++ -O3 -std=c++20 -fopenmp -mavx2 -mfma -mf16c -I"$TI" -DKC=16 -DPFD=1 -DVARIANT='"v_new.inc"' h.cpp -o h

#!/usr/bin/env bash
# Alternated A/B in-process (gpuserv bench, no peers): SmolLM2's projections in 4-bit panels (their exact
# Q4_1 grid, the default) against fp32 panels (GPUSERV_PANELS_Q4=0). fp32, mixed-short-long, 48 seqs.
cd /work/main
for i in 1 2; do
  for sw in 1 0; do
    GPUSERV_PANELS_Q4=$sw .venv/bin/gpuserv bench -w profiles/workloads/mixed-short-long.yaml -c profiles/engine/peers-48.yaml \
      --peers none --out /tmp/s21/q4ab-$sw-$i > /tmp/s21/q4ab-$sw-$i.log 2>&1
    echo "q4=$sw $(grep -E '^\| gpuserv \|' /tmp/s21/q4ab-$sw-$i/result.md | head -1)"
    grep -h "batch-1 step" /tmp/s21/q4ab-$sw-$i/result.md | sed 's/^/    /'
  done
done

#!/usr/bin/env bash
# a second base/main alternation of the fp32 AVX2 steps (the first main run's 48 x 64 was slower in every section, attention too)
cd /work/main; R=bench/results/2026-12-02-cpu-session14; BASE=/work/wt/base14
for t in base main base main; do d=$BASE; [ $t = main ] && d=/work/main; echo "== $t avx2 (round 2)" >> $R/profile-ab.txt
  (cd $d && PYTHONPATH=$d timeout 300 /work/main/.venv/bin/python /work/main/scripts/profile_decode_step.py --cases 8x480,48x64 --steps 20 --isa avx2 --dtype float32) >> $R/profile-ab.txt 2>&1; done
echo "== ab2 done $(date +%T)" >> $R/measure.log

#!/usr/bin/env bash
# End-of-session measurements on a quiet machine; each writes under $R.
set -x
PY=/work/main/.venv/bin/python
R=/work/main/bench/results/2026-12-01-cpu-session7
mkdir -p $R
grep -o -m1 'avx512_bf16\|avx2' /proc/cpuinfo > $R/cpu_isa.txt; lscpu | grep -i 'model name' >> $R/cpu_isa.txt
ab() {  # workload, tag
  for tree in base main; do
    d=/work/wt/$tree; [ $tree = main ] && d=/work/main
    (cd $d && PYTHONPATH=$d timeout 400 $PY -m gpuservd.cli.main bench --workload profiles/workloads/$1.yaml --peers none --out $R/renovation-$2-$tree) > $R/renovation-$2-$tree.log 2>&1
  done
}
ab mixed-short-long msl
ab burst-32x64 burst
ab mixed-short-long msl2
for tree in base main; do d=/work/wt/$tree; [ $tree = main ] && d=/work/main
  (cd $d && PYTHONPATH=$d timeout 300 $PY /work/wt/tokens_check.py profiles/workloads/mixed-short-long.yaml) > $R/tokens-$tree.log 2>&1; done
cd /work/main
PYTHONPATH=$PWD timeout 600 $PY -m gpuservd.cli.main bench -w profiles/workloads/shared-prefix-chat.yaml --config profiles/prefix-cache/on.yaml --compare profiles/prefix-cache/off.yaml --peers none --out $R/prefix-cache > $R/prefix-cache.log 2>&1
PYTHONPATH=$PWD timeout 400 $PY scripts/bench_structured.py --batch 32 --out $R/structured > $R/structured.log 2>&1
echo done > $R/DONE

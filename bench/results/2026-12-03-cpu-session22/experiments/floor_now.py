import json
from pathlib import Path
from transformers import AutoTokenizer
from gpuservd.bench.workload import load_workload
from gpuservd.bench.compute_floor import class_p99_floor
from gpuservd.store.store import ModelStore
w = load_workload(Path("profiles/workloads/mixed-short-long.yaml"))
d = ModelStore().path("smollm2")
tok = AutoTokenizer.from_pretrained(d)
reqs = w.materialize(len(tok), [tok.eos_token_id], tokenize=lambda s: tok.encode(s))
cfg = json.loads((d / "config.json").read_text())
print(json.dumps(class_p99_floor(reqs, cfg, "float32"), indent=1))

"""The GPU decode fast path, measured: step times eager vs CUDA graph vs an in-run ceiling, next to the
read floor; greedy agreement of the paths; throughput on random-length requests.

    python3 -m gpuservd.bench.fast_decode --out DIR [--device cuda:0] [--smoke] [--budget-s S]

Models are random weights of a real model's shape, built in memory (no store, no network: the GPU
machine has neither SmolLM2 nor room to carry it): SmolLM2-135M's shape and TinyLlama-1.1B's (~1B).
For each (batch, context) point, one decode step of `batch` sequences with `context` tokens cached:

- eager_ms: today's path (build_batch: host-built indices, synchronous copies) + greedy to the host;
- fixed_ms: the fixed-shape step run eagerly (bucket-padded, persistent inputs);
- graph_ms: the fixed-shape step replayed as a CUDA graph, greedy ids copied to the host;
- sampled_ms: the same with every row sampling (temperature 0.8, top_p 0.9, a seed each): the device
  sampler's graph replayed after the forward's, the drawn ids copied to the host;
- ceiling_ms: a static decode of the same weights with contiguous KV ([batch, kv_heads, context, d]
  per layer, SDPA) captured in one graph, gpt-fast style: what this GPU does with no paging at all;
- floor_ms: (weight bytes + KV bytes read) / the device copy bandwidth measured in this run.

The 256-request throughput runs three ways: eager, graphs with the engine's overlap off, and graphs
with it on (engine/overlap.py: step N+1 launched before step N's ids are read).

A mixed step (one prefill chunk beside decode rows) is timed both ways: one eager batch, as the engine
runs it, and the chunk eagerly followed by the decode rows through their graph (cuda_graphs.py says
why the engine keeps the first).

Each time is the median wall time of repeated steps, each ending in a host copy of the chosen ids
(what a serving step must wait for). On the CPU (`--device cpu --smoke`: tiny sizes) there are no
graphs: graph_ms and ceiling_ms are then the fixed-shape and static paths run eagerly, so the script
is known to run end to end before a GPU sees it (tests/test_bench_fast_decode.py).

Writes DIR/steps.json (a list of {model, batch, context, eager_ms, graph_ms, ceiling_ms, floor_ms,
fixed_ms, sampled_ms}), DIR/result.json (everything, versions included) and DIR/result.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

from gpuservd.bench.random_model import COLD_1B_SHAPE, SMOLLM2_SHAPE, LlamaShape
from gpuservd.config import CudaGraphsConfig, EngineConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
from gpuservd.runner import cuda_graphs, gpu_kernels
from gpuservd.runner.batch import SeqChunk
from gpuservd.runner.device_sampling import RowSampling
from gpuservd.runner.llama import rms_norm
from gpuservd.runner.model_runner import ModelRunner
from gpuservd.runner.rope import apply_rope

BLOCK_SIZE = 16
FULL_POINTS = [(b, 512) for b in (1, 8, 32, 64, 128, 256)] + [(64, 2048)]
SMOKE_POINTS = [(1, 40), (3, 24)]
SMOKE_SHAPE = LlamaShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300)
MODELS = {"smollm2-shape": SMOLLM2_SHAPE, "llama-1b-shape": COLD_1B_SHAPE}


class RandomSource:
    """A tensor source (get / has / names / shape) of random weights in a Llama's checkpoint names:
    N(0, 1/fan_in) matrices (activations stay of order one through the layers), norms near 1."""

    def __init__(self, shape: LlamaShape, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
        s = shape
        d, kv = s.hidden_size, s.hidden_size // s.num_attention_heads * s.num_key_value_heads
        # Drawn on the device where there is one: a 1B model's 4 GB of fp32 draws take seconds on the host.
        self.dtype, self.device, self.seed = dtype, torch.device(device), seed
        self._shapes = {"model.embed_tokens.weight": [s.vocab_size, d], "model.norm.weight": [d]}
        for i in range(s.num_hidden_layers):
            p = f"model.layers.{i}."
            self._shapes.update({
                p + "input_layernorm.weight": [d], p + "post_attention_layernorm.weight": [d],
                p + "self_attn.q_proj.weight": [d, d], p + "self_attn.k_proj.weight": [kv, d],
                p + "self_attn.v_proj.weight": [kv, d], p + "self_attn.o_proj.weight": [d, d],
                p + "mlp.gate_proj.weight": [s.intermediate_size, d], p + "mlp.up_proj.weight": [s.intermediate_size, d],
                p + "mlp.down_proj.weight": [d, s.intermediate_size]})

    def names(self) -> list[str]:
        return list(self._shapes)

    def has(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> list[int]:
        return self._shapes[name]

    def get(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        g = torch.Generator(device=self.device).manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
        x = torch.randn(shape, generator=g, device=self.device)
        return (1.0 + 0.1 * x if len(shape) == 1 else x * shape[1] ** -0.5).to(self.dtype)


def config_dir(root: Path, name: str, shape: LlamaShape) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": shape.hidden_size,
           "intermediate_size": shape.intermediate_size, "num_hidden_layers": shape.num_hidden_layers,
           "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_key_value_heads,
           "vocab_size": shape.vocab_size, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median wall time of fn() in ms (fn ends with a host read, so each call is complete)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    y = torch.empty_like(x)
    ms = median_ms(lambda: (y.copy_(x), _sync(device)), device, iters=10)
    return 2 * nbytes / (ms / 1e3)


def decode_chunks(batch: int, context: int, num_blocks: int, seed: int = 0) -> list[SeqChunk]:
    """batch sequences with context - 1 tokens cached, each on a random (scattered) set of blocks."""
    need = -(-context // BLOCK_SIZE)
    if batch * need > num_blocks:
        raise ValueError(f"{batch} x {context} tokens need {batch * need} blocks; the cache has {num_blocks}")
    rng = random.Random(seed)
    blocks = rng.sample(range(num_blocks), batch * need)
    return [SeqChunk([rng.randrange(3, 300)], context - 1, blocks[i * need:(i + 1) * need], True)
            for i in range(batch)]


class StaticDecode:
    """One decode step of the same weights over contiguous KV ([b, kv_heads, ctx, d] per layer), the
    query heads of each KV head as the query rows of one SDPA: no block tables, no padding."""

    def __init__(self, runner: ModelRunner, batch: int, context: int):
        m, a = runner.model, runner.arch
        self.model, self.arch, self.b, self.ctx = m, a, batch, context
        dev, dt = runner.device, runner.dtype
        self.k = [torch.randn(batch, a.num_kv_heads, context, a.head_dim, device=dev, dtype=dt)
                  for _ in range(a.num_layers)]
        self.v = [torch.randn_like(t) for t in self.k]
        self.ids = torch.randint(3, 300, (batch,), device=dev)
        self.pos = torch.full((batch,), context - 1, device=dev, dtype=torch.long)
        self.graph, self.out = None, None

    def forward(self) -> torch.Tensor:
        m, a, b = self.model, self.arch, self.b
        h = m.weights.embed_tokens(self.ids)
        cos, sin = m.rope.lookup(self.pos)
        group = a.num_heads // a.num_kv_heads
        for i in range(a.num_layers):
            lw = m.weights.layer(i)
            x = rms_norm(h, lw.input_norm, a.rms_norm_eps)
            qkv = lw.qkv(x).view(b, a.num_heads + 2 * a.num_kv_heads, a.head_dim)
            qk = apply_rope(qkv[:, : a.num_heads + a.num_kv_heads], cos, sin)
            self.k[i][:, :, self.ctx - 1] = qk[:, a.num_heads:]
            self.v[i][:, :, self.ctx - 1] = qkv[:, a.num_heads + a.num_kv_heads:]
            q = qk[:, : a.num_heads].reshape(b, a.num_kv_heads, group, a.head_dim)
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], scale=m.scale)
            h = h + lw.o_proj(o.reshape(b, a.num_heads * a.head_dim))
            x = rms_norm(h, lw.post_norm, a.rms_norm_eps)
            gate, up = lw.gate_up(x).chunk(2, dim=-1)
            h = h + lw.down(F.silu(gate) * up)
        logits = m.weights.lm_head.fp32(rms_norm(h, m.weights.final_norm, a.rms_norm_eps))
        return torch.argmax(logits, dim=-1)

    @torch.inference_mode()
    def step(self) -> list[int]:
        if self.graph is not None:
            self.graph.replay()
            return self.out.tolist()
        return self.forward().tolist()

    @torch.inference_mode()
    def capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.forward()


def block_bytes(shape: LlamaShape, dtype: str) -> int:
    """K and V of one block across all layers."""
    elem = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    head_dim = shape.hidden_size // shape.num_attention_heads
    return 2 * shape.num_hidden_layers * shape.num_key_value_heads * head_dim * BLOCK_SIZE * elem


def make_runner(cfg_dir: Path, shape: LlamaShape, device: str, dtype: str, kv_bytes: int, max_len: int):
    return ModelRunner(cfg_dir, dtype=dtype, device=device, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes,
                       device_memory_bytes=0, kv_cache_fraction=1.0, max_model_len=max_len,
                       weight_source=RandomSource(shape, torch.float32, device),
                       cuda_graphs_config=CudaGraphsConfig(enabled=False))


def measure_points(name: str, runner: ModelRunner, points, iters: int, bandwidth: float, log) -> list[dict]:
    """Every (batch, context) point of one model: eager, fixed-shape, graph, ceiling, floor."""
    dev, a = runner.device, runner.arch
    cuda = dev.type == "cuda"
    step = runner.enable_decode_step(sorted({bucket for bucket, _ in points}))
    if cuda:
        step.graphs = cuda_graphs.DecodeGraphs(step)
        took = step.graphs.capture(step.batch_sizes)
        log(f"{name}: captured graphs for batch sizes {list(step.batch_sizes)} in {took:.2f} s")
    runner.cache.kv.normal_()  # timed on random KV, not zeros
    kv_per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * runner.cache.kv.element_size()
    rows = []
    for batch, context in points:
        chunks = decode_chunks(batch, context, runner.cache.num_blocks, seed=batch + context)
        saved, runner.decode_step = runner.decode_step, None
        eager = median_ms(lambda: torch.argmax(runner.execute(chunks), -1).tolist(), dev, iters)
        runner.decode_step = saved
        graphs, step.graphs = step.graphs, None
        fixed = median_ms(lambda: torch.argmax(step.run(chunks).logits, -1).tolist(), dev, iters)
        step.graphs = graphs
        graph = median_ms(lambda: step.run(chunks).greedy.tolist(), dev, iters) if cuda else None
        drawn = [dataclasses.replace(c, sampling=RowSampling(0.8, 0, 0.9, 0.0, i, 0)) for i, c in enumerate(chunks)]
        sampled = median_ms(lambda: step.run(drawn).host(), dev, iters)
        static = StaticDecode(runner, batch, context)
        if cuda:
            static.capture()
        ceiling = median_ms(static.step, dev, iters)
        del static
        floor = (runner.load_report.weight_bytes + batch * context * kv_per_token) / bandwidth * 1e3
        row = {"model": name, "batch": batch, "context": context, "eager_ms": round(eager, 4),
               "graph_ms": None if graph is None else round(graph, 4), "ceiling_ms": round(ceiling, 4),
               "floor_ms": round(floor, 4), "fixed_ms": round(fixed, 4), "sampled_ms": round(sampled, 4)}
        log(f"{name} b={batch} ctx={context}: eager {eager:.3f} fixed {fixed:.3f} graph "
            f"{'-' if graph is None else f'{graph:.3f}'} sampled {sampled:.3f} ceiling {ceiling:.3f} floor {floor:.3f} ms")
        rows.append(row)
    return rows


def mixed_step(runner: ModelRunner, decode_rows: int, context: int, chunk: int, iters: int) -> dict:
    """A step that carries one prefill chunk beside decode rows, two ways: as one eager batch (what the
    engine does) and split (the chunk eagerly, then the decode rows through their graph)."""
    dev = runner.device
    rows = decode_chunks(decode_rows + 1, context, runner.cache.num_blocks, seed=11)
    decode, pre = rows[:decode_rows], rows[decode_rows]
    start = context - chunk
    prefill = SeqChunk(list(range(3, 3 + chunk)), start, pre.block_ids, True)
    step = runner.decode_step

    def one_batch():
        saved, runner.decode_step = runner.decode_step, None
        try:
            return torch.argmax(runner.execute([prefill] + decode), -1).tolist()
        finally:
            runner.decode_step = saved

    def split():
        torch.argmax(runner.execute([prefill]), -1)
        return step.run(decode).chosen.tolist()

    return {"decode_rows": decode_rows, "context": context, "prefill_tokens": chunk,
            "one_eager_batch_ms": round(median_ms(one_batch, dev, iters), 4),
            "prefill_eager_plus_decode_graph_ms": round(median_ms(split, dev, iters), 4),
            "decode_path": step.last_path}


def greedy_agreement(cfg_dir: Path, shape: LlamaShape, device: str, dtype: str, num_prompts: int,
                     max_tokens: int) -> dict:
    """Greedy tokens of the graph path (with and without overlap) against the eager fixed-shape step (the
    same shapes: must be equal) and against today's eager batch (other matmul shapes: agreement
    reported); and seeded sampling through the device sampler's graph against the fixed-shape step."""
    g = random.Random(7)
    prompts = [[g.randrange(3, 300) for _ in range(g.randrange(8, 40))] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    drawn = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, temperature=0.8, top_p=0.9,
                            seed=i) for i in range(num_prompts)]
    outs = {}
    for label in ("eager", "fixed", "graph", "graph_overlap", "fixed_sampled", "graph_sampled"):
        cfg = EngineConfig(model="bench", device=device, dtype=dtype, block_size=BLOCK_SIZE,
                           kv_cache_bytes=64 << 20, max_model_len=512,
                           cuda_graphs=CudaGraphsConfig(enabled=False), overlap=label.startswith("graph"))
        eng = LLMEngine("bench", cfg_dir, cfg, tokenizer=_NoTokenizer(),
                        weight_source=RandomSource(shape, torch.float32, device))
        if label != "eager":
            step = eng.runner.enable_decode_step([1, 2, 4, 8, 16])
            if label.startswith("graph") and eng.runner.device.type == "cuda":
                step.graphs = cuda_graphs.DecodeGraphs(step)
                step.graphs.capture(step.batch_sizes)
        if label.endswith("sampled"):
            for i, (p, sp) in enumerate(zip(prompts, drawn)):
                eng.add_request(f"s{i}", p, sp)
            got: dict = {}
            while eng.has_unfinished():
                for o in eng.step():
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
            outs[label] = [got[f"s{i}"] for i in range(num_prompts)]
        else:
            outs[label] = eng.generate(prompts, params)
    same = sum(a == b for x, y in zip(outs["graph"], outs["eager"]) for a, b in zip(x, y))
    total = sum(len(x) for x in outs["graph"])
    return {"graph_equals_fixed_eager": outs["graph"] == outs["fixed"], "graph_equals_eager": outs["graph"] == outs["eager"],
            "graph_vs_eager_token_agreement": round(same / max(1, total), 4), "tokens": total,
            "overlap_equals_graph": outs["graph_overlap"] == outs["graph"],
            "sampled_graph_equals_fixed": outs["graph_sampled"] == outs["fixed_sampled"]}


class _NoTokenizer:
    """The benchmarks send token ids and read token ids: no tokenizer is loaded."""

    eos_token_id = None


def throughput(cfg_dir: Path, shape: LlamaShape, device: str, dtype: str, num_requests: int, lo: int, hi: int,
               graphs: bool, budget_s: float, overlap: bool = False) -> dict:
    """nano-vLLM's recipe: num_requests requests, input and output lengths uniform in [lo, hi]; output
    tokens per second of the whole run (stopped at budget_s, counting what finished by then)."""
    g = random.Random(0)
    reqs = [([g.randrange(3, 300) for _ in range(g.randint(lo, hi))], g.randint(lo, hi)) for _ in range(num_requests)]
    need = sum(-(-(len(p) + n) // BLOCK_SIZE) for p, n in reqs) + 16
    cfg = EngineConfig(model="bench", device=device, dtype=dtype, block_size=BLOCK_SIZE, max_model_len=2 * hi + 16,
                       cuda_graphs=CudaGraphsConfig(enabled=graphs), overlap=overlap)
    cfg.kv_cache_bytes = need * block_bytes(shape, dtype)
    cfg.scheduler.max_num_seqs = min(256, num_requests)
    cfg.scheduler.max_num_batched_tokens = max(1024, cfg.scheduler.max_num_seqs)
    cfg.scheduler.max_prefill_tokens = 1024
    cfg.preemption.mode = "off"
    eng = LLMEngine("bench", cfg_dir, cfg, tokenizer=_NoTokenizer(),
                    weight_source=RandomSource(shape, torch.float32, device))
    for i, (p, n) in enumerate(reqs):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False))
    t0 = time.perf_counter()
    out_tokens, steps, done = 0, 0, 0
    while eng.has_unfinished() and time.perf_counter() - t0 < budget_s:
        for o in eng.step():
            out_tokens += len(o.new_token_ids)
            done += o.finished
        steps += 1
    took = time.perf_counter() - t0
    return {"graphs": graphs, "overlap": eng.overlap, "decode_path": eng.decode_status()["path"], "requests": num_requests,
            "finished": done, "output_tokens": out_tokens, "steps": steps, "seconds": round(took, 3),
            "tokens_per_s": round(out_tokens / took, 2), "complete": not eng.has_unfinished()}


def versions(device: torch.device) -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
         "cuda": torch.version.cuda}
    try:
        import triton  # optional: only CUDA builds of torch bring it

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        v.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
        v["kernels"] = gpu_kernels.status()
    return v


def write_results(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.json").write_text(json.dumps(result["steps"], indent=1) + "\n")
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Decode fast path ({result['versions'].get('gpu', result['versions']['device'])})", "",
             "| model | batch | context | eager ms | fixed ms | graph ms | sampled ms | ceiling ms | floor ms "
             "| graph / ceiling |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["steps"]:
        ratio = f"{r['graph_ms'] / r['ceiling_ms']:.2f}" if r["graph_ms"] and r["ceiling_ms"] else "-"
        graph = r["graph_ms"] if r["graph_ms"] is not None else "-"
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['eager_ms']} | {r['fixed_ms']} | "
                     f"{graph} | {r['sampled_ms']} | {r['ceiling_ms']} | {r['floor_ms']} | {ratio} |")
    lines += ["", "mixed steps (one prefill chunk beside decode rows):"]
    lines += [f"- {json.dumps(m)}" for m in result.get("mixed", [])]
    lines += ["", f"greedy: {json.dumps(result.get('greedy'))}", "", "throughput:"]
    lines += [f"- {json.dumps(t)}" for t in result.get("throughput", [])]
    (out / "result.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU check that the script runs)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop starting new sections after this")
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: no CUDA device here", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)  # noqa: E731
    smoke = args.smoke
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    models = {"tiny-shape": SMOKE_SHAPE} if smoke else MODELS
    points = SMOKE_POINTS if smoke else FULL_POINTS
    iters = args.iters or (3 if smoke else 30)
    result = {"versions": versions(device), "dtype": dtype, "steps": [], "skipped": []}
    bw = copy_bandwidth(device, (64 << 20) if smoke or device.type == "cpu" else (2 << 30))
    result["copy_bandwidth_gbs"] = round(bw / 1e9, 1)
    log(f"versions {result['versions']}; copy bandwidth {bw / 1e9:.0f} GB/s")
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {name: config_dir(Path(tmp), name, shape) for name, shape in models.items()}
        max_len = max(c for _, c in points) + BLOCK_SIZE
        for name, shape in models.items():
            if time.perf_counter() - t0 > args.budget_s:
                result["skipped"].append(f"steps {name}")
                continue
            blocks = max(b * -(-c // BLOCK_SIZE) for b, c in points) + 8
            runner = make_runner(dirs[name], shape, args.device, dtype, blocks * block_bytes(shape, dtype), max_len)
            result["steps"] += measure_points(name, runner, points, iters, bw, log)
            mixed = mixed_step(runner, *((3, 24, 8) if smoke else (32, 512, 256)), iters=iters)
            result.setdefault("mixed", []).append({"model": name, **mixed})
            log(f"{name} mixed step: {mixed}")
            del runner
            if device.type == "cuda":
                torch.cuda.empty_cache()
        first, shape = next(iter(models.items()))
        result["greedy"] = greedy_agreement(dirs[first], shape, args.device, dtype, 4 if smoke else 8,
                                            6 if smoke else 48)
        log(f"greedy {result['greedy']}")
        n, lo, hi = (6, 4, 12) if smoke else (256, 100, 1024)
        result["throughput"] = []
        ways = [(False, False), (True, False), (True, True)]  # (graphs, overlap)
        for k, (graphs, overlap) in enumerate(ways):
            left = args.budget_s - (time.perf_counter() - t0)
            if left < 20 and not smoke:
                result["skipped"].append(f"throughput graphs={graphs} overlap={overlap}")
                continue
            run = throughput(dirs[first], shape, args.device, dtype, n, lo, hi, graphs,
                             max(10.0, left / (len(ways) - k)), overlap=overlap)
            result["throughput"].append(run)
            log(f"throughput {run}")
    write_results(args.out, result)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

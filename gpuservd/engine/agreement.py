"""How well a model's INT8 weights keep its answers, against the full-precision weights.

Two measures, both greedy:
- teacher-forced top-1 agreement: the full-precision model's own greedy replies to the prompts are fed to
  both weight sets as one sequence each (same prefix at every position), and the two next-token argmaxes
  are compared at every position, prompt and reply. It isolates the per-step error: one early divergence
  does not spoil the rest, as it does in free running.
- free-running agreement: each weight set generates its own greedy reply of `new_tokens` tokens; how many
  replies are identical, the share of equal tokens at equal positions, and the share before the first
  difference. This is what a user sees.

Measured in the engine's dtype on the engine's device: the INT8 weights are expanded to it, so the
comparison is INT8-then-expanded against the same dtype loaded directly.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from gpuservd.config import EngineConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
from gpuservd.engine.tokenizer import encode_chat, encode_raw
from gpuservd.runner.batch import SeqChunk, build_batch
from gpuservd.runner.load import SafetensorsReader
from gpuservd.weights.int8_file import Int8Reader, ensure_int8, read_agreement, write_agreement

# Eight chat prompts of the kinds people send (the test: 8 replies of 32 greedy tokens).
CHAT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.", "List three prime numbers.",
    "How do I boil an egg?", "Translate 'good morning' into Spanish.",
    "Give me a tip for writing clean Python code.", "Why is the sky blue?",
]
NEW_TOKENS = 32


def prompts_for(tokenizer, texts: list[str] = CHAT_PROMPTS) -> list[list[int]]:
    """The prompts through the chat template where the model has one, else as plain text."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    return [encode_chat(tokenizer, [{"role": "user", "content": t}]) if chat else encode_raw(tokenizer, t)
            for t in texts]


def position_logits(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """fp32 logits [len(tokens), V] at every position of one sequence, in one prefill (an idle engine:
    the sequence takes the pool's first blocks)."""
    runner = engine.runner
    blocks = list(range(-(-len(tokens) // runner.block_size)))
    batch = build_batch([SeqChunk(tokens, 0, blocks, True)], runner.block_size, runner.device)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(tokens), device=runner.device))
    return runner.model.forward(batch, runner.cache.layer)


def teacher_forced_top1(ref: LLMEngine, other: LLMEngine, sequences: list[list[int]]) -> tuple[float, int]:
    """Share of positions where both engines' next-token argmax agree, over every position of every
    sequence (same prefix for both); returns (share, positions)."""
    same = total = 0
    for seq in sequences:
        a = position_logits(ref, seq).argmax(dim=-1)
        b = position_logits(other, seq).argmax(dim=-1)
        same += int((a == b).sum())
        total += len(seq)
    return same / total, total


def free_running(ref_out: list[list[int]], other_out: list[list[int]]) -> dict:
    """Identical replies, equal tokens at equal positions, and the share before the first difference."""
    total = sum(len(a) for a in ref_out)
    equal = sum(x == y for a, b in zip(ref_out, other_out) for x, y in zip(a, b))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                 for a, b in zip(ref_out, other_out))
    return {"replies": len(ref_out), "identical": sum(a == b for a, b in zip(ref_out, other_out)),
            "token_agreement": equal / total if total else 1.0,
            "identical_prefix_share": prefix / total if total else 1.0}


def compare(ref: LLMEngine, other: LLMEngine, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> dict:
    """Both measures for two engines of one model (e.g. full precision and INT8)."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    a, b = ref.generate(prompts, params), other.generate(prompts, params)
    share, positions = teacher_forced_top1(ref, other, [p + r for p, r in zip(prompts, a)])
    return {"teacher_forced_top1": share, "positions": positions, "new_tokens": new_tokens,
            "free_running": free_running(a, b), "outputs_ref": a, "outputs_other": b}


def measure_int8(model: str, model_dir: Path, cfg: EngineConfig, prompts: list[list[int]] | None = None,
                 new_tokens: int = NEW_TOKENS, store: bool = True) -> dict:
    """The INT8 file (made when missing or stale) against the full-precision weights, in cfg's dtype and
    device; stored beside the INT8 file (int8/agreement.json) unless store=False."""
    model_dir = Path(model_dir)
    cfg = dataclasses.replace(cfg, kv_cache_bytes=min(cfg.kv_cache_bytes or 64 << 20, 64 << 20))
    t0 = time.perf_counter()
    reader = SafetensorsReader(model_dir)
    path = ensure_int8(reader, model_dir)
    ref = LLMEngine(model, model_dir, cfg, weight_source=reader)
    q8 = LLMEngine(model, model_dir, cfg, weight_source=Int8Reader(path), tokenizer=ref.tokenizer)
    got = compare(ref, q8, prompts if prompts is not None else prompts_for(ref.tokenizer), new_tokens)
    got.pop("outputs_ref"), got.pop("outputs_other")
    got.update(dtype=cfg.dtype, device=cfg.device, measured_s=round(time.perf_counter() - t0, 2),
               int8_bytes=path.stat().st_size, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if store:
        write_agreement(model_dir, got)
    return got


def summary_line(a: dict) -> str:
    """One line for a person: teacher-forced top-1 and free-running agreement."""
    fr = a["free_running"]
    return (f"teacher-forced top-1 {100 * a['teacher_forced_top1']:.2f}% over {a['positions']} positions; "
            f"free-running {fr['identical']}/{fr['replies']} replies of {a['new_tokens']} greedy tokens identical, "
            f"{100 * fr['token_agreement']:.1f}% of tokens equal ({a.get('dtype', '?')})")


def int8_verdict(model: str, model_dir: Path, cfg: EngineConfig, minimum: float) -> str | None:
    """None when the model's INT8 weights keep its answers (teacher-forced top-1 agreement at or above
    `minimum`), else why int8 is refused, with the numbers. The stored measurement is used when it is the
    current INT8 file's; otherwise it is measured now (once: the result is stored)."""
    if minimum <= 0:
        return None
    numbers = read_agreement(model_dir) or measure_int8(model, model_dir, cfg)
    if numbers["teacher_forced_top1"] >= minimum:
        return None
    return (f"int8 refused for {model}: {summary_line(numbers)}, under cache.int8_min_agreement "
            f"{100 * minimum:.2f}%; served at full precision")

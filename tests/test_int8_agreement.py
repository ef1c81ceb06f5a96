"""How well INT8 weights keep the model's answers: teacher-forced top-1 and free-running agreement."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gpuservd.config import EngineConfig
from gpuservd.engine.agreement import compare, free_running, measure_int8, position_logits, teacher_forced_top1
from gpuservd.engine.engine import LLMEngine
from gpuservd.runner.batch import SeqChunk
from gpuservd.runner.load import SafetensorsReader
from gpuservd.weights.int8_file import Int8Reader, int8_path, read_agreement, write_int8


def cfg() -> EngineConfig:
    c = EngineConfig(model="tiny", dtype="float32", block_size=4, kv_cache_bytes=4 << 20)
    c.validate()
    return c


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_model_dir):
    d = tmp_path_factory.mktemp("agree") / "tiny"
    shutil.copytree(tiny_model_dir, d)
    return d


def test_free_running_counts_identical_replies_equal_tokens_and_the_common_prefix():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    other = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    assert free_running(ref, other) == {"replies": 3, "identical": 1, "token_agreement": 10 / 12,
                                        "identical_prefix_share": (4 + 2 + 0) / 12}


def test_position_logits_are_the_runners_own_at_every_position(model):
    """Position i's logits equal what the runner returns for a prompt that ends at position i."""
    eng = LLMEngine("tiny", model, cfg())
    tokens = [5, 17, 42, 99, 7, 3, 250, 12, 31]
    every = position_logits(eng, tokens)
    assert every.shape == (len(tokens), eng.runner.arch.vocab_size)
    for end in (1, 4, len(tokens)):
        blocks = list(range(-(-end // 4)))
        last = eng.runner.execute([SeqChunk(tokens[:end], 0, blocks, True)])
        torch.testing.assert_close(every[end - 1], last[0], rtol=1e-4, atol=1e-4)


def test_the_measures_see_damage(model):
    """Against itself a model agrees everywhere; INT8 weights with scales off by 2x (damage a broken expansion
    would do) lose most positions, group-wise INT8 keeps nearly all."""
    ref = LLMEngine("tiny", model, cfg())
    prompts = [[5 + i, 17, 42 + i, 99, 7, 3] for i in range(4)]
    same = compare(ref, ref, prompts, new_tokens=8)
    assert same["teacher_forced_top1"] == 1.0 and same["free_running"]["identical"] == 4
    assert same["positions"] == 4 * (6 + 8)
    write_int8(SafetensorsReader(model), model)
    good = LLMEngine("tiny", model, cfg(), weight_source=Int8Reader(int8_path(model)), tokenizer=ref.tokenizer)
    bad_reader = Int8Reader(int8_path(model))
    qtensor = bad_reader._qtensor
    bad_reader._qtensor = lambda name: (lambda q: type(q)(q.q, q.scale * 2, q.group_size))(qtensor(name))
    bad = LLMEngine("tiny", model, cfg(), weight_source=bad_reader, tokenizer=ref.tokenizer)
    seqs = [p + r for p, r in zip(prompts, same["outputs_ref"])]
    ok, _ = teacher_forced_top1(ref, good, seqs)
    broken, _ = teacher_forced_top1(ref, bad, seqs)
    assert ok >= 0.9 and broken < ok - 0.2, (ok, broken)


def test_measure_int8_stores_its_numbers_beside_the_file(model):
    a = measure_int8("tiny", model, cfg())
    assert 0.9 <= a["teacher_forced_top1"] <= 1.0 and a["positions"] > 8 * 32
    assert a["free_running"]["replies"] == 8 and a["new_tokens"] == 32 and a["dtype"] == "float32"
    stored = read_agreement(model)
    assert stored["teacher_forced_top1"] == a["teacher_forced_top1"]
    assert json.loads((model / "int8" / "agreement.json").read_text())["int8_file"]["format"] == "4"

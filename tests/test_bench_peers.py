"""The transformers peers on a tiny random Llama: exact output lengths, sane timings."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gpuservd.bench.peers import run_hf_continuous, run_hf_static  # noqa: E402
from gpuservd.bench.workload import WorkloadRequest  # noqa: E402

# (prompt tokens, output tokens, arrival offset s)
SHAPES = [(10, 5, 0.0), (20, 12, 0.0), (7, 3, 0.05), (30, 16, 0.1)]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer, 64-wide random Llama saved like any local Hugging Face directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_requests() -> list[WorkloadRequest]:
    # Prompts full of EOS-free ids; the tiny model would happily emit EOS, which must not stop anything.
    return [WorkloadRequest(f"r{i}", "a" if i % 2 else "b", t, [100 + (7 * i + j) % 800 for j in range(p)], o)
            for i, (p, o, t) in enumerate(SHAPES)]


def check_run(run, system: str):
    assert run.system == system
    reqs = make_requests()
    assert [t.request_id for t in run.requests] == [r.request_id for r in reqs]
    for t, r in zip(run.requests, reqs):
        assert t.output_tokens == r.output_tokens
        assert t.prompt_tokens == len(r.prompt_token_ids)
        assert t.arrival_s == r.arrival_s
        assert t.arrival_s <= t.first_token_s <= t.finish_s <= run.wall_s + 1e-9
    assert run.extra["token_check"] == {"expected": 36, "counted": 36, "ok": True}
    assert 0 < run.wall_s < 30


def test_hf_static_exact_lengths(tiny_model_dir):
    run = run_hf_static(tiny_model_dir, make_requests(), "float32", max_num_seqs=3, num_threads=2)
    check_run(run, "hf_static")
    # Batch 1 = r0..r2 (waits for r2's arrival), batch 2 = r3; everyone in a batch returns at its end.
    b1, b2 = run.extra["batches"]
    assert (b1["size"], b1["new_tokens"], b2["size"], b2["new_tokens"]) == (3, 12, 1, 16)
    assert b1["start_s"] >= 0.05 and b1["wasted_tokens"] == (12 - 5) + (12 - 3)
    assert len({t.finish_s for t in run.requests[:3]}) == 1
    logical = run.extra["logical_finish_s"]
    assert logical["r2"] < logical["r0"] < logical["r1"] <= run.requests[0].finish_s


def test_hf_continuous_exact_lengths(tiny_model_dir):
    run = run_hf_continuous(tiny_model_dir, make_requests(), "float32", max_num_seqs=3, num_threads=2)
    check_run(run, "hf_continuous")
    assert run.extra["cb_config"]["max_requests_per_batch"] == 3
    # (Which request finishes first is a wall-clock race on a loaded 2-core machine, so it is not
    # asserted here; per-request finish times are checked for order against arrival in check_run.)


def test_wrong_dtype_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown dtype"):
        run_hf_static(tiny_model_dir, make_requests(), "float8", max_num_seqs=2)

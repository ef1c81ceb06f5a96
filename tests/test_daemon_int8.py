"""compression: int8 per model, and refused (with the numbers) for a model whose INT8 weights do not keep its
answers: the daemon's app in-process, on the tiny model (teacher-forced top-1 ~95% under group-wise INT8)."""

from __future__ import annotations

import pytest

from daemon_harness import make_home
from inprocess_app import run_in_app
from gpuservd.weights.int8_file import int8_path, read_agreement


@pytest.fixture()
def home(tmp_path, monkeypatch, tiny_model_dir):
    h = make_home(tmp_path, tiny_model_dir, names=("tiny", "tiny2"))
    monkeypatch.setenv("GPUSERV_HOME", str(h))
    return h


def config(minimum: float) -> dict:
    return {"engine": {"dtype": "float32", "kv_cache_bytes": "2MiB", "block_size": 4, "num_threads": 1},
            "server": {"models": []},
            "cache": {"compression": "none", "compression_models": {"tiny": "int8"},
                      "int8_min_agreement": minimum, "host_bytes": 0}}


async def ask(client, model):
    r = await client.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200, r.text


async def models(client) -> dict:
    return {m["name"]: m for m in (await client.get("/admin/status")).json()["models"]}


def test_int8_per_model_kept_when_it_agrees_and_refused_with_the_numbers_when_not(home):
    tiny = home / "models" / "tiny"

    async def accepted(client, serving):
        await ask(client, "tiny")
        await ask(client, "tiny2")
        m = await models(client)
        # int8 for tiny only (compression_models), measured on its first load and stored beside the file
        assert (m["tiny"]["source_tier"], m["tiny"]["compression"], m["tiny"]["compression_refused"]) == \
            ("disk-int8", "int8", None)
        assert (m["tiny2"]["source_tier"], m["tiny2"]["compression"]) == ("disk", "none")
        assert not int8_path(home / "models" / "tiny2").exists()

    run_in_app(accepted, config(0.9))
    numbers = read_agreement(tiny)
    assert 0.9 <= numbers["teacher_forced_top1"] < 0.999

    async def refused(client, serving):
        await ask(client, "tiny")  # still served: at full precision
        m = (await models(client))["tiny"]
        assert (m["source_tier"], m["compression"]) == ("disk", "none")
        why = m["compression_refused"]
        assert f"teacher-forced top-1 {100 * numbers['teacher_forced_top1']:.2f}%" in why
        assert "under cache.int8_min_agreement 99.90%" in why and "served at full precision" in why

    run_in_app(refused, config(0.999))

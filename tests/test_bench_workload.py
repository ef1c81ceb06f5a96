"""Workload files: validation messages, determinism, class counts, arrivals, traces."""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from gpuservd.bench.workload import load_workload
from gpuservd.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "profiles" / "workloads"

GOOD = """\
name: t
model: smollm2
seed: 7
requests: 64
arrival: {process: burst}
classes:
  - name: short
    share: 0.875
    prompt_tokens: {dist: uniform, min: 16, max: 64}
    output_tokens: {dist: uniform, min: 16, max: 64}
  - name: long
    share: 0.125
    prompt_tokens: {dist: uniform, min: 16, max: 64}
    output_tokens: {dist: lognormal, median: 384, sigma: 0.3, min: 256, max: 512}
"""


def write(tmp_path: Path, text: str, name: str = "w.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(UserError) as e:
        load_workload(write(tmp_path, text))
    msg = str(e.value)
    assert "\n" not in msg
    assert "w.yaml" in msg  # every message names the file
    return msg


@pytest.mark.parametrize(
    "old, new, field, expected",
    [
        ("median: 384", "median: -1", "classes[1].output_tokens.median", "number > 0"),
        ("median: 384", "median: lots", "classes[1].output_tokens.median", "number > 0"),
        ("dist: lognormal", "dist: zipf", "classes[1].output_tokens.dist", "fixed, uniform, lognormal"),
        ("min: 16, max: 64}\n    output", "min: 64, max: 16}\n    output", "classes[0].prompt_tokens.max", "max >= min"),
        ("share: 0.125", "share: 0.2", "classes", "sum to 1"),
        ("requests: 64", "requests: 0", "requests", "integer >= 1"),
        ("requests: 64", "requests: 2.5", "requests", "integer >= 1"),
        ("{process: burst}", "{process: steady}", "arrival.process", "burst, poisson, trace"),
        ("{process: burst}", "{process: poisson}", "arrival.rate", "missing"),
        ("{process: burst}", "{process: poisson, rate: 0}", "arrival.rate", "number > 0"),
        ("seed: 7", "seed: 7\nsede: 3", "", "unknown field(s) sede"),
        ("    share: 0.875\n", "    share: 0.875\n    colour: red\n", "classes[0]", "unknown field(s) colour"),
        ("  - name: long", "  - name: short", "classes[1].name", "duplicate"),
        ("name: t\n", "", "name", "missing"),
        ("prompt_tokens: {dist: uniform, min: 16, max: 64}\n    output_tokens: {dist: lognormal",
         "prompt_tokens: {dist: fixed}\n    output_tokens: {dist: lognormal", "classes[1].prompt_tokens.value", "missing"),
    ],
)
def test_validation_errors_name_file_and_field(tmp_path, old, new, field, expected):
    assert old in GOOD
    msg = error_of(tmp_path, GOOD.replace(old, new, 1))
    assert f": {field}: " in msg if field else True, msg
    assert expected in msg, msg


def test_not_a_mapping_and_bad_yaml(tmp_path):
    assert "expected a mapping" in error_of(tmp_path, "- 1\n- 2\n")
    assert "not valid YAML at line" in error_of(tmp_path, "name: [unclosed\n")
    with pytest.raises(UserError, match="not found"):
        load_workload(tmp_path / "nope.yaml")


def test_deterministic_with_seed(tmp_path):
    wl = load_workload(write(tmp_path, GOOD))
    a = wl.materialize(49152, eos_token_id=2)
    b = load_workload(write(tmp_path, GOOD)).materialize(49152, eos_token_id=2)
    assert [(r.cls, r.prompt_token_ids, r.output_tokens, r.arrival_s) for r in a] == \
           [(r.cls, r.prompt_token_ids, r.output_tokens, r.arrival_s) for r in b]
    c = load_workload(write(tmp_path, GOOD.replace("seed: 7", "seed: 8"))).materialize(49152, eos_token_id=2)
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


def test_exact_class_counts_lengths_and_token_ids(tmp_path):
    reqs = load_workload(write(tmp_path, GOOD)).materialize(1000, eos_token_id=150)
    assert Counter(r.cls for r in reqs) == {"short": 56, "long": 8}
    assert len({r.request_id for r in reqs}) == 64
    for r in reqs:
        assert 16 <= len(r.prompt_token_ids) <= 64
        assert all(100 <= t < 999 and t != 150 for t in r.prompt_token_ids)
        lo, hi = (16, 64) if r.cls == "short" else (256, 512)
        assert lo <= r.output_tokens <= hi
        assert r.arrival_s == 0.0 and r.model == "smollm2" and r.priority == 0 and r.tenant == "default"
    assert [r.cls for r in reqs] != sorted(r.cls for r in reqs)  # shuffled, not grouped


def test_class_count_remainder_goes_to_largest_share(tmp_path):
    text = GOOD.replace("requests: 64", "requests: 10")  # 8.75 -> 9 short, 1.25 -> 1 long
    assert Counter(r.cls for r in load_workload(write(tmp_path, text)).materialize(1000)) == {"short": 9, "long": 1}
    three = GOOD.replace("requests: 64", "requests: 3").replace("0.875", "0.5").replace("0.125", "0.5")
    assert Counter(r.cls for r in load_workload(write(tmp_path, three)).materialize(1000)) == {"short": 2, "long": 1}


def test_poisson_mean_interarrival(tmp_path):
    text = GOOD.replace("requests: 64", "requests: 2000").replace("{process: burst}", "{process: poisson, rate: 4}")
    reqs = load_workload(write(tmp_path, text)).materialize(1000)
    t = [r.arrival_s for r in reqs]
    assert t[0] == 0.0 and t == sorted(t)
    mean_gap = t[-1] / (len(t) - 1)
    assert 0.25 * 0.9 < mean_gap < 0.25 * 1.1


def test_trace_with_relative_path_and_text_prompt(tmp_path):
    sub = tmp_path / "traces"
    sub.mkdir()
    lines = [
        {"t": 0.5, "model": "smollm2", "class": "short", "prompt_tokens": 40, "output_tokens": 32},
        {"t": 0.12, "class": "long", "prompt": "hello there world", "output_tokens": 300, "priority": 2,
         "tenant": "bob"},
        {"t": 0.9, "class": "short", "prompt_tokens": 10},  # output length drawn from the class
    ]
    (sub / "t.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    text = GOOD.replace("requests: 64\n", "").replace("{process: burst}", "{process: trace, path: traces/t.jsonl}")
    wl = load_workload(write(tmp_path, text))
    with pytest.raises(UserError, match="tokenizer"):
        wl.materialize(1000)
    reqs = wl.materialize(1000, tokenize=lambda s: [7] * len(s.split()))
    assert [r.arrival_s for r in reqs] == [0.12, 0.5, 0.9]  # sorted by time
    assert reqs[0].prompt_token_ids == [7, 7, 7] and reqs[0].priority == 2 and reqs[0].tenant == "bob"
    assert len(reqs[1].prompt_token_ids) == 40 and reqs[1].output_tokens == 32
    assert 16 <= reqs[2].output_tokens <= 64
    limited = load_workload(write(tmp_path, text.replace("seed: 7", "seed: 7\nrequests: 2")))
    assert len(limited.materialize(1000, tokenize=lambda s: [7])) == 2


def test_trace_errors_name_file_and_line(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"t": 0, "class": "short", "prompt_tokens": 4, "output_tokens": 4}\n'
                                      '{"t": 0.1, "class": "short", "prompt_tokens": 4, "output_tokens": 0}\n')
    text = GOOD.replace("{process: burst}", "{process: trace, path: t.jsonl}")
    with pytest.raises(UserError, match=r"t\.jsonl: line 2\.output_tokens: expected an integer >= 1"):
        load_workload(write(tmp_path, text))
    (tmp_path / "t.jsonl").write_text('{"t": 0, "class": "medium", "prompt_tokens": 4, "output_tokens": 4}\n')
    with pytest.raises(UserError, match="unknown class 'medium'"):
        load_workload(write(tmp_path, text))
    (tmp_path / "t.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match="line 1: not valid JSON"):
        load_workload(write(tmp_path, text))
    with pytest.raises(UserError, match="arrival.path: trace file .* does not exist"):
        load_workload(write(tmp_path, text.replace("t.jsonl", "missing.jsonl")))


@pytest.mark.parametrize("path", sorted(WORKLOADS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_workloads_load(path):
    wl = load_workload(path)
    reqs = wl.materialize(49152, eos_token_id=2, tokenize=lambda s: [5] * len(s.split()))
    assert reqs and all(r.output_tokens >= 1 and r.prompt_token_ids for r in reqs)


def test_shipped_workload_shapes():
    mixed = load_workload(WORKLOADS / "mixed-short-long.yaml").materialize(49152, eos_token_id=2)
    assert Counter(r.cls for r in mixed) == {"short": 56, "long": 8}
    burst = load_workload(WORKLOADS / "burst-32x64.yaml").materialize(49152, eos_token_id=2)
    assert len(burst) == 32 and {(len(r.prompt_token_ids), r.output_tokens, r.arrival_s) for r in burst} == {(32, 64, 0.0)}
    assert len(load_workload(WORKLOADS / "smoke.yaml").materialize(49152)) == 8


@pytest.mark.parametrize("path", sorted((WORKLOADS.parent / "preemption").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_preemption_configs_load(path):
    from gpuservd.config import load_config

    cfg = load_config(path)
    assert cfg.preemption.mode in ("on", "off") or path.name == "kv-default.yaml"  # that one is the built-in defaults


def test_shared_prefix_chat_builds_conversations_that_resend_their_history():
    """16 conversations x 4 turns over one 600-token system prompt: every prompt starts with it, and a
    turn's prompt extends its conversation's previous prompt (plus that turn's reply and a new message)."""
    from gpuservd.bench.chat import expected_prefix_hits

    reqs = load_workload(WORKLOADS / "shared-prefix-chat.yaml").materialize(49152, eos_token_id=2)
    assert len(reqs) == 64 and [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    system = reqs[0].prompt_token_ids[:600]
    assert all(r.prompt_token_ids[:600] == system for r in reqs)
    for j, r in enumerate(reqs):
        if j >= 16:  # turn j // 16 of conversation j % 16
            prev = reqs[j - 16]
            added = len(r.prompt_token_ids) - len(prev.prompt_token_ids)
            assert r.prompt_token_ids[:len(prev.prompt_token_ids)] == prev.prompt_token_ids
            assert 20 + prev.output_tokens <= added <= 60 + prev.output_tokens
        else:
            assert 620 <= len(r.prompt_token_ids) <= 660
    hits, queries = expected_prefix_hits([r.prompt_token_ids for r in reqs], 16)
    # By construction: the first request reuses nothing, the other 15 first turns the system prompt's 37 full
    # blocks, and every later turn its previous turn's prompt in full blocks.
    want = 15 * 592 + sum(len(reqs[j - 16].prompt_token_ids) // 16 * 16 for j in range(16, 64))
    assert hits == want and queries == sum(len(r.prompt_token_ids) for r in reqs)
    assert 0.8 < hits / queries < 0.95


def test_other_workloads_keep_their_prompts_when_chats_exist():
    """The chat construction draws from a stream of its own: a workload without
    chats materializes the same prompts whether or not chats exist elsewhere."""
    import numpy as np

    reqs = load_workload(WORKLOADS / "smoke.yaml").materialize(49152, eos_token_id=2)
    wl = load_workload(WORKLOADS / "smoke.yaml")
    rng_tok = np.random.default_rng(np.random.SeedSequence(wl.seed).spawn(4)[3])
    from gpuservd.bench.workload import _random_prompt

    assert reqs[0].prompt_token_ids == _random_prompt(rng_tok, len(reqs[0].prompt_token_ids), 49152, {2})

"""Structured output in the engine: llguidance matchers per request, masks per step, no leaked state."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from gpuservd.config import EngineConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.grammar import Grammars, to_grammar
from gpuservd.engine.request import GuidedSpec, SamplingParams
from gpuservd.errors import FieldError
from schemas import SCHEMAS


@pytest.fixture(scope="module")
def eng(tiny_model_dir):
    return LLMEngine("tiny", tiny_model_dir, EngineConfig(model="tiny", kv_cache_bytes=4 << 20, block_size=4,
                                                          num_threads=1))


def run(eng, rid, params, prompt="hello"):
    outs = list(eng.stream(rid, eng.tokenizer.encode(prompt), params))
    return "".join(o.new_text for o in outs), outs[-1]


def json_params(schema, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 150)
    return SamplingParams(guided=GuidedSpec("json_schema", json.dumps(schema), "response_format"), **kw)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_twenty_schemas_give_valid_json_greedy_and_sampled(eng, i):
    for k, extra in enumerate((dict(), dict(temperature=1.0, seed=i))):
        text, last = run(eng, f"s{i}-{k}", json_params(SCHEMAS[i], **extra))
        jsonschema.validate(json.loads(text), SCHEMAS[i])
        assert last.finish_reason.value == "stop"
    assert eng.grammars.num_live == 0 and eng.pool.num_used == 0


def test_unconstrained_rows_in_the_same_batch_are_untouched(eng):
    plain = SamplingParams(max_tokens=12, ignore_eos=True, detokenize=False)
    alone = eng.generate([[30, 31, 32]], plain)[0]
    eng.add_request("g", eng.tokenizer.encode("x"), json_params(SCHEMAS[9]))
    eng.add_request("p", [30, 31, 32], SamplingParams(**vars(plain)))
    got = []
    while eng.has_unfinished():
        got += [t for o in eng.step() if o.request_id == "p" for t in o.new_token_ids]
    assert got == alone


def test_regex_choice_and_grammar(eng):
    text, _ = run(eng, "re", SamplingParams(max_tokens=40, guided=GuidedSpec("regex", r"[a-c]{2}-\d{3}", "guided_regex")))
    assert len(text) == 6 and text[2] == "-" and text[3:].isdigit() and set(text[:2]) <= set("abc")
    text, _ = run(eng, "ch", SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                            guided=GuidedSpec("choice", json.dumps(["alpha", "beta"]), "guided_choice")))
    assert text in ("alpha", "beta")
    gbnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    text, _ = run(eng, "gb", SamplingParams(max_tokens=40, guided=GuidedSpec("grammar", gbnf, "guided_grammar")))
    assert text.startswith("(") and text.endswith(")") and all(c in "123456789+" for c in text[1:-1])
    text, _ = run(eng, "jo", SamplingParams(max_tokens=80, guided=GuidedSpec("json_object", "", "response_format")))
    assert isinstance(json.loads(text), dict)


def test_grammar_that_forces_eos_early_frees_everything(eng):
    # The grammar is complete after two characters, long before max_tokens, and even with ignore_eos.
    for ignore_eos in (False, True):
        text, last = run(eng, f"early{ignore_eos}", SamplingParams(
            max_tokens=100, ignore_eos=ignore_eos, guided=GuidedSpec("regex", "ok", "guided_regex")))
        assert text == "ok" and last.finish_reason.value == "stop" and last.num_output_tokens <= 2
    assert eng.grammars.num_live == 0 and eng.pool.num_used == 0 and not eng.requests


def test_cancel_mid_grammar_frees_the_matcher_and_the_blocks(eng):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 500}
    eng.add_request("long", eng.tokenizer.encode("x"), json_params(schema, max_tokens=300))
    eng.add_request("other", eng.tokenizer.encode("y"), json_params(SCHEMAS[0]))
    for _ in range(5):
        eng.step()
    assert eng.grammars.num_live == 2
    final = eng.abort("long")
    assert final.finish_reason.value == "abort"
    assert eng.grammars.num_live == 1 and "long" not in eng.grammars.live
    while eng.has_unfinished():
        eng.step()
    assert eng.grammars.num_live == 0 and eng.pool.num_used == 0


@pytest.mark.parametrize("spec,field,message", [
    (GuidedSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}}),
                "response_format.json_schema"), "response_format.json_schema", "nope"),
    (GuidedSpec("json_schema", "{not json", "guided_json"), "guided_json", "could not be compiled"),
    (GuidedSpec("regex", "(unclosed", "guided_regex"), "guided_regex", "regex"),
    (GuidedSpec("grammar", "root ::= missing_rule", "guided_grammar"), "guided_grammar", "could not be compiled"),
])
def test_bad_grammars_name_their_field(eng, spec, field, message):
    with pytest.raises(FieldError, match=message) as exc:
        to_grammar(spec)
    assert exc.value.param == field
    with pytest.raises(FieldError):
        eng.add_request("bad", [5, 6], SamplingParams(max_tokens=5, guided=spec))
    assert eng.grammars.num_live == 0 and not eng.requests and eng.pool.num_used == 0


def fresh_engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine("tiny", tiny_model_dir, EngineConfig(model="tiny", kv_cache_bytes=4 << 20, block_size=4,
                                                          num_threads=1))


def test_the_grammar_tokenizer_is_built_off_the_engine_thread_while_the_batch_runs(tiny_model_dir, monkeypatch):
    eng = fresh_engine(tiny_model_dir)
    gate, threads = threading.Event(), []
    real_build = Grammars._build

    def gated_build(self):
        threads.append(threading.current_thread().name)
        gate.wait()
        return real_build(self)

    monkeypatch.setattr(Grammars, "_build", gated_build)
    eng.add_request("plain", [30, 31, 32], SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False))
    eng.step()
    eng.add_request("json", eng.tokenizer.encode("x"), json_params(SCHEMAS[3]))
    with pytest.raises(FieldError, match="regex"):  # a bad grammar is still refused at once
        eng.add_request("bad", [1], SamplingParams(guided=GuidedSpec("regex", "(unclosed", "guided_regex")))
    plain_tokens = 0
    for _ in range(6):  # the batch goes on while the tokenizer is being built
        plain_tokens += sum(len(o.new_token_ids) for o in eng.step() if o.request_id == "plain")
        assert "json" in eng.grammars.pending and eng.grammars.num_live == 0
    assert plain_tokens == 6 and threads == ["grammar-tokenizer"]
    gate.set()
    text = ""
    while eng.has_unfinished():
        text += "".join(o.new_text for o in eng.step() if o.request_id == "json")
    jsonschema.validate(json.loads(text), SCHEMAS[3])
    assert eng.grammars.num_live == 0 and not eng.grammars.pending and eng.pool.num_used == 0


def test_a_request_cancelled_while_waiting_for_the_tokenizer_leaves_nothing(tiny_model_dir, monkeypatch):
    eng = fresh_engine(tiny_model_dir)
    gate = threading.Event()
    real_build = Grammars._build
    monkeypatch.setattr(Grammars, "_build", lambda self: gate.wait() and real_build(self))
    eng.add_request("json", eng.tokenizer.encode("x"), json_params(SCHEMAS[0]))
    assert eng.has_unfinished()
    assert eng.abort("json").finish_reason.value == "abort"
    gate.set()
    assert not eng.has_unfinished() and not eng.grammars.pending and not eng.requests
    assert eng.pool.num_used == 0 and eng.grammars.num_live == 0


def test_masks_computed_beside_the_forward_give_the_same_tokens(eng, monkeypatch):
    # CUDA engines compute the masks on a worker while the forward runs; forced on here.
    names = []
    real_fill = Grammars.fill

    def fill(self, requests):
        if any(r.grammar is not None for r in requests):
            names.append(threading.current_thread().name)
        return real_fill(self, requests)

    monkeypatch.setattr(Grammars, "fill", fill)

    def batch():
        for k in range(3):
            eng.add_request(f"ov{k}", eng.tokenizer.encode(f"item {k}"),
                            json_params(SCHEMAS[k], temperature=1.0, seed=k, max_tokens=60))
        eng.add_request("ovp", [30, 31], SamplingParams(max_tokens=20, temperature=1.0, seed=9, detokenize=False))
        got = {}
        while eng.has_unfinished():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        return got

    eng.grammars.overlap = False
    names.clear()
    inline = batch()
    assert names and set(names) == {threading.current_thread().name}
    eng.grammars.overlap = True
    names.clear()
    try:
        beside = batch()
    finally:
        eng.grammars.overlap = False
    assert beside == inline
    assert names and all(n.startswith("grammar-mask") for n in names)
    assert eng.grammars.num_live == 0 and eng.pool.num_used == 0

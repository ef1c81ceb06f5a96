"""The OpenAI surface over the real daemon with the `openai` client on the socket, streamed and not:
logprobs, penalties, logit_bias, min_tokens, seed, n / best_of, echo, stop, usage, structured output
(20 JSON schemas, guided_* fields), tool calls (two turns) and the router extension fields."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from daemon_harness import DaemonProcess, make_home
from schemas import SCHEMAS

MSGS = [{"role": "user", "content": "hello there"}]
EOS = 2  # the tiny tokenizer's <|im_end|>
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a", "b"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("daemon-surface")
    d = DaemonProcess(tmp, make_home(tmp, tiny_model_dir), config={"scheduler": {"max_num_seqs": 16},
                                                                 "server": {"max_n": 4}})
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop(wait_exit=False)


@pytest.fixture(scope="module")
def client(daemon):
    from openai import OpenAI

    c = OpenAI(api_key="unused", base_url="http://localhost/v1", max_retries=0,
               http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), timeout=120))
    yield c
    c.close()


def chat(client, stream=False, **kw):
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 8)
    if not stream:
        return client.chat.completions.create(model="tiny", **kw)
    return list(client.chat.completions.create(model="tiny", stream=True,
                                               stream_options={"include_usage": True}, **kw))


def streamed_text(chunks, index=0) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


def test_chat_logprobs_streamed_and_not(client):
    r = chat(client, temperature=0, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    for e in lp:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].token == e.token  # greedy: the most likely token is the one taken
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    chunks = chat(client, stream=True, temperature=0, logprobs=True, top_logprobs=3)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in lp]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completion_logprobs_n(client):
    r = client.completions.create(model="tiny", prompt="the capital of", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    # A token that ends inside a UTF-8 character shows as U+FFFD; the text holds such a tail back.
    assert "".join(lp.tokens).startswith(r.choices[0].text) and lp.text_offset[0] == 0
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)


def test_logit_bias_min_tokens_and_penalties(client):
    forced = chat(client, temperature=0, logit_bias={"77": 100}, extra_body={"return_token_ids": True})
    assert set(forced.choices[0].token_ids) == {77}
    # EOS is biased to the top, but min_tokens holds it back for 4 tokens.
    r = chat(client, temperature=0, max_tokens=20, logit_bias={str(EOS): 100}, extra_body={"min_tokens": 4})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 5
    plain = chat(client, temperature=0, max_tokens=16, extra_body={"return_token_ids": True}).choices[0].token_ids
    pen = chat(client, temperature=0, max_tokens=16, frequency_penalty=2.0, presence_penalty=2.0,
               extra_body={"repetition_penalty": 1.5, "return_token_ids": True}).choices[0].token_ids
    assert len(set(pen)) >= len(set(plain)) and pen != plain
    # The same through a stream.
    chunks = chat(client, stream=True, temperature=0, max_tokens=20, logit_bias={str(EOS): 100},
                  extra_body={"min_tokens": 4})
    assert chunks[-1].usage.completion_tokens == 5
    chunks = chat(client, stream=True, temperature=0, max_tokens=16, frequency_penalty=2.0, presence_penalty=2.0,
                  extra_body={"repetition_penalty": 1.5, "return_token_ids": True})
    assert [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])] == pen


def test_seed_n_and_stream_usage(client):
    one = chat(client, temperature=1.0, seed=11, max_tokens=6)
    three = chat(client, temperature=1.0, seed=11, max_tokens=6, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].message.content == one.choices[0].message.content  # choice i runs with seed + i
    assert len({c.message.content for c in three.choices}) > 1
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert 3 <= three.usage.completion_tokens <= 18
    chunks = chat(client, stream=True, temperature=1.0, seed=11, max_tokens=6, n=3)
    for i in range(3):
        assert streamed_text(chunks, i) == three.choices[i].message.content
    assert chunks[-1].usage.completion_tokens == three.usage.completion_tokens
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 3


def test_best_of_echo_and_stop(client):
    r = client.completions.create(model="tiny", prompt="a quick", max_tokens=4, temperature=1.0, seed=5, best_of=3,
                                  n=1, extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 12  # every candidate's tokens count
    e = client.completions.create(model="tiny", prompt="the capital", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt="the capital", max_tokens=3, temperature=0)
    assert e.choices[0].text == "the capital" + plain.choices[0].text
    s = list(client.completions.create(model="tiny", prompt="the capital", max_tokens=3, temperature=0, echo=True,
                                       stream=True))
    assert "".join(c.choices[0].text for c in s if c.choices) == e.choices[0].text
    full = plain.choices[0].text
    if len(full) > 2:
        cut = client.completions.create(model="tiny", prompt="the capital", max_tokens=3, temperature=0,
                                        stop=["zzz", "yyy", "xxx", full[1:3]])
        assert cut.choices[0].text == full[:1] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_output_validates(client, i):
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}
    stream = i % 2 == 1
    kw = dict(max_tokens=150, temperature=1.0, seed=i, response_format=fmt)
    text = streamed_text(chat(client, stream=True, **kw)) if stream else chat(client, **kw).choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMAS[i])


def test_guided_fields_and_json_object(client):
    # Any object: nothing bounds its strings, and a random model may not close one within max_tokens.
    r = chat(client, max_tokens=120, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert isinstance(json.loads(text), dict) if r.choices[0].finish_reason == "stop" else text.startswith("{")
    r = client.completions.create(model="tiny", prompt="x", max_tokens=20, extra_body={"guided_regex": r"\d{3}-[ab]"})
    assert len(r.choices[0].text) == 5 and r.choices[0].text[3] == "-"
    r = chat(client, max_tokens=20, temperature=1.0, seed=1, extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].message.content in ("left", "right")
    r = chat(client, max_tokens=20, extra_body={"guided_json": {"type": "integer", "minimum": 5, "maximum": 7}})
    assert 5 <= json.loads(r.choices[0].message.content) <= 7
    r = chat(client, max_tokens=20, extra_body={"guided_grammar": 'root ::= "ab" [0-9]'})
    assert r.choices[0].message.content[:2] == "ab" and len(r.choices[0].message.content) == 3


def test_tool_calls_round_trip_two_turns(client):
    first = chat(client, max_tokens=80, tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.content is None
    call = msg.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = chat(client, messages=history, max_tokens=8, tools=TOOLS, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt
    # Without tools offered (tool_choice none) the earlier turns still render, as text.
    third = chat(client, messages=history, max_tokens=4, tools=TOOLS, tool_choice="none", temperature=0)
    assert third.choices[0].message.tool_calls is None and third.usage.prompt_tokens > len(MSGS[0]["content"])


def test_tool_calls_stream_as_deltas(client):
    chunks = chat(client, stream=True, max_tokens=80, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0].function.name in ("get_weather", "add")
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(deltas[0].function.arguments), params[deltas[0].function.name])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    auto = chat(client, max_tokens=6, tools=TOOLS, temperature=0)  # a random model: plain text, no call
    assert auto.choices[0].message.content is not None and auto.choices[0].finish_reason in ("stop", "length")


ROUTER_FIELDS = {"no_stop_trim": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
                 "continue_final_message": False, "add_generation_prompt": True, "ignore_eos": False,
                 "include_stop_str_in_output": False, "top_k": -1, "min_p": 0, "return_tokens_as_token_ids": False,
                 "user": "u1", "chat_template_kwargs": {}, "separate_reasoning": True, "stream_reasoning": True,
                 "return_hidden_states": False, "include_reasoning": True, "session_params": {"session_id": "s"},
                 "repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": []}


def test_router_fields_are_tolerated_and_non_neutral_ones_refused(daemon):
    with daemon.http() as h:
        r = h.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 3, **ROUTER_FIELDS})
        assert r.status_code == 200, r.text
        r = h.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "continue_final_message": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
        r = h.post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": 5})
        assert r.status_code == 400 and "server.max_n" in r.json()["error"]["message"]
        st = h.get("/admin/status").json()
    tiny = {m["name"]: m for m in st["models"]}["tiny"]
    assert tiny["kv_blocks_free"] == tiny["kv_blocks_total"]  # every choice's blocks came back


@pytest.mark.smollm2
def test_smollm2_json_schemas_and_a_tool_call(tmp_path_factory, real_store_home):
    if real_store_home is None:
        pytest.skip("SmolLM2 is not in the store")
    from openai import OpenAI

    tmp = tmp_path_factory.mktemp("daemon-smol")
    d = DaemonProcess(tmp, real_store_home, config={"server": {"models": ["smollm2"]},
                                                    "engine": {"kv_cache_bytes": "64MiB", "block_size": 16}})
    try:
        d.wait_ready(180)
        c = OpenAI(api_key="unused", base_url="http://localhost/v1", max_retries=0,
                   http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(d.socket)), timeout=300))

        def record(i):
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[i]}}
            return c.chat.completions.create(model="smollm2", max_tokens=120, temperature=0, response_format=fmt,
                                             messages=[{"role": "user", "content": "Give me a record."}])

        def weather():
            return c.chat.completions.create(model="smollm2", max_tokens=80, temperature=0, tools=TOOLS,
                                             tool_choice="required",
                                             messages=[{"role": "user", "content": "Weather in Paris?"}])

        # The four requests at once: the engine batches their decode steps (each grammar masks its own row),
        # so they take about as many steps as the longest alone instead of the sum of all four.
        with ThreadPoolExecutor(4) as pool:
            records = {i: pool.submit(record, i) for i in (0, 9, 16)}
            tool = pool.submit(weather)
            for i, r in records.items():
                jsonschema.validate(json.loads(r.result().choices[0].message.content), SCHEMAS[i])
            r = tool.result()
        call = r.choices[0].message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments),
                            {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name])
        c.close()
    finally:
        d.stop(wait_exit=False)


def test_client_leaving_an_n_stream_mid_grammar_frees_every_choice(daemon):
    from daemon_harness import wait_until

    body = {"model": "tiny", "messages": MSGS, "max_tokens": 500, "n": 3, "stream": True, "temperature": 1.0,
            "guided_json": {"type": "array", "items": {"type": "integer"}, "minItems": 400}}
    with daemon.http() as h, h.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(12)]
        assert any('"index":2' in line for line in got) or any('"index":1' in line for line in got)
        with daemon.http() as admin:
            rows = admin.get("/admin/requests").json()["requests"]
        assert len(rows) == 3  # one engine request per choice, each says what applies
        assert all(r["sampling"] == "t=1 n=3 json_schema (guided_json)" for r in rows)
        from typer.testing import CliRunner

        from gpuservd.cli.main import app

        out = CliRunner().invoke(app, ["requests", "ls"], env={"GPUSERV_SOCKET": str(daemon.socket),
                                                                "COLUMNS": "250"}).output
        assert out.count("json_schema (guided_json)") == 3, out
    wait_until(lambda: daemon.status()["num_in_flight"] == 0, 10, what="the three choices to be aborted")

    def tiny_blocks():
        tiny = {m["name"]: m for m in daemon.status()["models"]}["tiny"]
        return tiny["kv_blocks_free"], tiny["kv_blocks_total"]

    # The API releases a request when its client leaves; the engine frees the choices' blocks when it takes
    # the aborts at its next step, a moment later. A leak never frees them and fails here.
    wait_until(lambda: tiny_blocks()[0] == tiny_blocks()[1], 10,
               what=lambda: f"every choice's KV blocks to be freed (free, total: {tiny_blocks()})")


def test_cli_generate_json_schema_and_logprobs_through_the_daemon(daemon, tmp_path):
    from typer.testing import CliRunner

    from gpuservd.cli.main import app

    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMAS[5]))  # integers and objects: bounded lengths
    env = {"GPUSERV_SOCKET": str(daemon.socket)}
    for raw in ([], ["--raw"]):
        r = CliRunner().invoke(app, ["generate", "-m", "tiny", "-n", "80", "--json-schema", str(path),
                                     "--logprobs", "3", *raw, "hello"], env=env)
        assert r.exit_code == 0, r.output
        jsonschema.validate(json.loads(r.stdout.strip()), SCHEMAS[5])
        assert sum("top:" in line for line in r.stderr.splitlines()) >= 5


LONG_N3 = {"model": "tiny", "messages": MSGS, "max_tokens": 500, "n": 3, "temperature": 1.0,
           "guided_json": {"type": "array", "items": {"type": "integer"}, "minItems": 400}}


def _all_freed(daemon):
    from daemon_harness import wait_until

    wait_until(lambda: daemon.status()["num_in_flight"] == 0, 10, what="every choice to end")
    tiny = {m["name"]: m for m in daemon.status()["models"]}["tiny"]
    assert tiny["kv_blocks_free"] == tiny["kv_blocks_total"]


def _wait_choices(daemon, n):
    from daemon_harness import wait_until

    def running():
        with daemon.http() as admin:
            rows = admin.get("/admin/requests").json()["requests"]
        return len(rows) == n and all(r["num_output_tokens"] > 0 for r in rows)

    wait_until(running, 20, what=f"{n} choices generating")


def test_cancelling_an_n_stream_by_its_id_cancels_every_choice(daemon):
    with daemon.http() as h, h.stream("POST", "/v1/chat/completions", json={**LONG_N3, "stream": True},
                                      headers={"X-Request-Id": "n3-stream"}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "n3-stream"
        lines = r.iter_lines()
        next(lines)
        _wait_choices(daemon, 3)
        with daemon.http() as admin:
            assert admin.post("/admin/requests/n3-stream/cancel").json()["cancelled"] is True
        finishes = {}
        for line in lines:
            if line.startswith("data: {"):
                for c in json.loads(line[6:]).get("choices", []):
                    if c.get("finish_reason"):
                        finishes[c["index"]] = c["finish_reason"]
    assert finishes == {0: "abort", 1: "abort", 2: "abort"}
    _all_freed(daemon)
    with daemon.http() as admin:  # nothing left to cancel under that id
        assert admin.post("/admin/requests/n3-stream/cancel").status_code == 404


def test_cancelling_an_n_request_by_its_id_cancels_every_choice(daemon):
    import threading

    got = {}

    def run():
        with daemon.http(timeout=120) as h:
            got["r"] = h.post("/v1/chat/completions", json=LONG_N3, headers={"X-Request-Id": "n3-whole"})

    t = threading.Thread(target=run)
    t.start()
    _wait_choices(daemon, 3)
    with daemon.http() as admin:
        assert admin.post("/admin/requests/n3-whole/cancel").json()["cancelled"] is True
    t.join(60)
    body = got["r"].json()
    assert [c["finish_reason"] for c in body["choices"]] == ["abort", "abort", "abort"]
    _all_freed(daemon)


def test_a_client_leaving_a_whole_n_request_frees_every_choice(daemon):
    import socket

    payload = json.dumps(LONG_N3).encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(daemon.socket))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    _wait_choices(daemon, 3)
    s.close()
    _all_freed(daemon)


def test_echo_with_logprobs_gives_the_prompt_tokens_their_logprobs(client):
    plain = client.completions.create(model="tiny", prompt="the capital of", max_tokens=4, temperature=0,
                                      logprobs=2)
    e = client.completions.create(model="tiny", prompt="the capital of", max_tokens=4, temperature=0, echo=True,
                                  logprobs=2)
    lp, out = e.choices[0].logprobs, plain.choices[0].logprobs
    n = len(lp.tokens) - len(out.tokens)
    assert n >= 3 and e.choices[0].text == "the capital of" + plain.choices[0].text
    assert "".join(lp.tokens[:n]) == "the capital of"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:n])
    assert all(len(t) == 2 for t in lp.top_logprobs[1:n])
    assert lp.tokens[n:] == out.tokens and lp.token_logprobs[n:] == pytest.approx(out.token_logprobs, abs=1e-4)
    assert lp.text_offset[:n] == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert lp.text_offset[n:] == [o + len("the capital of") for o in out.text_offset]
    s = list(client.completions.create(model="tiny", prompt="the capital of", max_tokens=4, temperature=0,
                                       echo=True, logprobs=2, stream=True))
    streamed = [c.choices[0].logprobs for c in s if c.choices and c.choices[0].logprobs]
    assert sum((x.tokens for x in streamed), []) == lp.tokens
    values = sum((x.token_logprobs for x in streamed), [])
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    assert sum((x.text_offset for x in streamed), []) == lp.text_offset


def test_required_tool_choice_may_call_several_tools_unless_parallel_is_off(client):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    r = chat(client, max_tokens=400, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and r.choices[0].message.content is None
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    assert len({c.id for c in calls}) == len(calls)
    one = chat(client, max_tokens=400, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3,
               parallel_tool_calls=False)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="parallel_tool_calls must be a boolean"):
        chat(client, tools=TOOLS, extra_body={"parallel_tool_calls": "yes"})

"""Incremental detokenization: the fast decode gives the tokenizer's own text, and the streamed pieces
add up to the decode of the whole output (multi-byte characters split across tokens included)."""

from __future__ import annotations

import random

import pytest

from gpuservd.engine import detokenizer
from gpuservd.engine.request import Request, SamplingParams
from gpuservd.engine.tokenizer import load_tokenizer


@pytest.fixture(params=["tiny", "smollm2"])
def tokenizer(request, tiny_model_dir):
    path = tiny_model_dir if request.param == "tiny" else request.getfixturevalue("smollm2_dir")
    return load_tokenizer(path)


def _ids(tokenizer, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    text = "Grüße, 東京 🙂 naïve café — x² + y² = z²; tabs\tand\nnewlines. "
    ids = tokenizer.encode(text * 3, add_special_tokens=False)
    # and random ids, special tokens among them: those that do not decode alone must not break anything
    return ids + [rng.randrange(len(tokenizer)) for _ in range(n)]


def test_the_fast_decode_is_the_tokenizers_decode(tokenizer):
    decode = detokenizer.decoder(tokenizer)
    assert detokenizer.decoder(tokenizer) is decode  # built once per tokenizer
    ids = _ids(tokenizer, 300, 1)
    for at in range(0, len(ids), 7):
        window = ids[at:at + 9]
        assert decode(window) == tokenizer.decode(window, skip_special_tokens=True)


@pytest.mark.parametrize("num_random", [0, 200])
def test_streamed_pieces_add_up_to_the_whole_decode(tokenizer, num_random):
    prompt = tokenizer.encode("Hello there", add_special_tokens=False)
    out = _ids(tokenizer, num_random, 2)
    req = Request(request_id="r", prompt_token_ids=prompt, params=SamplingParams(max_tokens=len(out)))
    detokenizer.start(req)
    pieces = []
    for tok in out:
        assert detokenizer.step(tokenizer, req, tok) is None
        pieces.append(detokenizer.take_new_text(req, False))
    pieces.append(detokenizer.take_new_text(req, True))
    whole = tokenizer.decode(prompt + out, skip_special_tokens=True)
    head = tokenizer.decode(prompt, skip_special_tokens=True)
    assert "".join(pieces) == whole[len(head):]
    if not num_random:  # valid text: half a character is never streamed (random ids may never complete one)
        assert all("\ufffd" not in p for p in pieces)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    tok.clean_up_tokenization_spaces = True
    ids = tok.encode("a , b . c !", add_special_tokens=False)
    calls = []
    original = tok.decode
    tok.decode = lambda *a, **k: calls.append(1) or original(*a, **k)
    assert detokenizer.decoder(tok)(ids) == original(ids, skip_special_tokens=True) and calls

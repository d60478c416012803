"""Orca's OpenAI layer without a server: text made as tokens arrive, stop strings, request parsing, cancel."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from handlers.orca.engine import OrcaEngine
from handlers.orca.gpt2 import SelectiveGPT2
from handlers.orca.openai_api import CHAT, COMPLETIONS, Answer, OpenAIError, parse_request
from handlers.orca.text import TextCodec, TextStream
from tests.user_archives import TEXTS, save_small_tokenizer


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> TextCodec:
    return TextCodec.load(save_small_tokenizer(tmp_path_factory.mktemp("tok")), vocab=300)


def stream_all(codec: TextCodec, ids: list[int], stops: tuple[str, ...]) -> tuple[TextStream, str]:
    text = TextStream(codec, stops)
    pieces = []
    for token in ids:
        pieces.append(text.push(token))
        if text.stopped:
            break
    pieces.append(text.finish())
    return text, "".join(pieces)


def test_streamed_pieces_add_up_to_the_text_and_a_stop_string_spanning_tokens_ends_it(codec):
    ids = codec.encode(TEXTS[1])
    _, whole = stream_all(codec, ids, ())
    assert whole == TEXTS[1]
    text, streamed = stream_all(codec, ids, ("request it",))
    assert text.stopped and streamed == text.text == "Once upon a time a small server answered every "
    assert len(text.ids) < len(ids)  # it ended on the token that completed the stop string


def test_a_piece_of_a_stop_string_is_held_back_until_it_cannot_be_one(codec):
    text = TextStream(codec, ("lazy cat",))
    out = ""
    for token in codec.encode("the quick brown fox jumps over the lazy dog"):
        piece = text.push(token)
        assert "lazy" not in out + piece or "lazy d" in out + piece  # "lazy" only once "d" rules the stop out
        out += piece
    assert out + text.finish() == "the quick brown fox jumps over the lazy dog" and not text.stopped


def test_a_character_split_across_tokens_is_sent_whole(codec):
    text = TextStream(codec)
    out = [text.push(t) for t in codec.encode("東京")]
    assert "".join(out) == "東京" and all("\ufffd" not in piece for piece in out)


@given(st.lists(st.integers(5, 299), max_size=40), st.lists(st.text("abcdefghijklmnopqrstuvwxyz .", min_size=1,
                                                                    max_size=4), max_size=3))  # fmt: skip
def test_any_tokens_and_stops_the_text_is_the_decoding_cut_before_the_first_stop(codec, ids, stops):
    text, streamed = stream_all(codec, ids, tuple(stops))
    decoded = codec.decode(text.ids)
    assert streamed == text.text
    assert not any(s in text.text for s in stops)
    if text.stopped:
        assert any(decoded[len(text.text) :].startswith(s) for s in stops)
    else:
        assert text.text == codec.decode(ids)


def body(**fields) -> dict:
    return {"model": "m", "prompt": "the quick", **fields}


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"best_of": 3}, "best_of", "not supported"),
        ({"n": 2}, "n", "not supported"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ({"logprobs": 2}, "logprobs", "not supported"),
        ({"beams": 2}, "beams", "unrecognized request argument"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"stop": 3}, "stop", "a string or a list"),
        ({"prompt": ["one", "two"]}, "prompt", "one prompt per request"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": {"text": "x"}}, "prompt", "string or a list of token ids"),
        ({"temperature": 3}, "temperature", "[0, 2]"),
        ({"top_p": 0}, "top_p", "(0, 1]"),
        ({"max_tokens": 0}, "max_tokens", "≥ 1"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
        ({"model": None}, "model", "required"),
    ],
)
def test_a_bad_completion_request_is_a_400_naming_its_field(codec, fields, param, words):
    with pytest.raises(OpenAIError) as caught:
        parse_request(COMPLETIONS, body(**fields), codec)
    error = json.loads(caught.value.body())["error"]
    assert caught.value.status == 400 and error["param"] == param and words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_openai_defaults_and_the_prompt_forms(codec):
    ask = parse_request(COMPLETIONS, body(), codec)
    assert ask.sampling.temperature == 1.0 and ask.max_tokens is None and ask.stops == () and not ask.stream
    assert parse_request(COMPLETIONS, body(prompt=[7, 8, 9]), codec).prompt_ids == [7, 8, 9]
    assert parse_request(COMPLETIONS, body(prompt=["the quick"]), codec).prompt_ids == codec.encode("the quick")
    ask = parse_request(COMPLETIONS, body(stop="x", stream=True, stream_options={"include_usage": True}, top_k=-1,
                                          temperature=0, seed=3, n=1, logprobs=None), codec)  # fmt: skip
    assert ask.stops == ("x",) and ask.include_usage and ask.sampling.top_k == 0 and ask.sampling.greedy


def test_chat_messages_go_through_the_checkpoints_template(codec):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text",
                                                                                         "text": "hi"}]}]  # fmt: skip
    ask = parse_request(CHAT, {"model": "m", "messages": messages, "max_completion_tokens": 5}, codec)
    expected = "<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    assert codec.tokenizer.decode(ask.prompt_ids) == expected and ask.max_tokens == 5
    with pytest.raises(OpenAIError, match="role in"):
        parse_request(CHAT, {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, codec)
    codec.tokenizer.chat_template, template = None, codec.tokenizer.chat_template
    try:
        with pytest.raises(OpenAIError, match="no chat template"):
            parse_request(CHAT, {"model": "m", "messages": messages}, codec)
    finally:
        codec.tokenizer.chat_template = template


def test_without_a_tokenizer_the_routes_say_what_is_missing():
    with pytest.raises(OpenAIError, match="tokenizer.json"):
        parse_request(COMPLETIONS, body(), None)


def test_a_stream_closes_with_the_finish_reason_usage_and_done(codec):
    ask = parse_request(CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                               "stream_options": {"include_usage": True}}, codec)  # fmt: skip
    answer = Answer(ask, "served")
    events = [e for e in (answer.opening() + answer.piece("he") + answer.closing("llo", "stop", 4)).split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1]) == "hello"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert {c["id"] for c in chunks} == {answer.id} and answer.id.startswith("chatcmpl-")


def test_a_cancelled_request_ends_early_and_frees_its_slot():
    import transformers

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64,
                                                               vocab_size=300)).eval()  # fmt: skip
    engine = OrcaEngine(SelectiveGPT2(hf), slots=1, max_tokens=64, max_batch=2, max_new_tokens=60)
    try:
        started = threading.Event()
        first = engine.submit([1, 2, 3], 60, lambda t, i, last: started.set())
        waiting = engine.submit([4, 5], 3)  # needs the only slot
        assert started.wait(30)
        assert engine.cancel(first)
        assert len(first.result(timeout=30)) < 60
        assert len(waiting.result(timeout=30)) == 3
        assert not engine.cancel(first)  # already answered
    finally:
        engine.close(10)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    from handlers.orca.text import TokenizerError

    with pytest.raises(TokenizerError, match="300 tokens but the model's vocabulary holds 200"):
        TextCodec.load(save_small_tokenizer(tmp_path), vocab=200)

"""Orca's OpenAI-compatible routes through a real TorchServe, driven by the official ``openai`` client.

The model is a user's: a Llama-family checkpoint with grouped-query attention
and a byte-level BPE tokenizer with a chat template, both written by
``save_pretrained`` here, archived with the real ``torch-model-archiver``
(one-line entry file, the tokenizer files as extra files).  Greedy answers
must equal transformers' ``generate`` on the same prompt, streamed or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from serving_harness.loadgen import open_loop, run
from serving_harness.torchserve import TorchServeProcess
from tests.serving.test_handlers_on_users_archives import ASYNC, user_archive
from tests.user_archives import save_small_tokenizer, tokenizer_files

pytestmark = pytest.mark.torchserve

NAME = "users-chat"
CONTEXT = 64
EOS = 0  # the tokenizer's <|endoftext|>


@pytest.fixture(scope="module")
def torchserve(model_store_dir, tmp_path_factory) -> Iterator[TorchServeProcess]:
    """This module's own TorchServe, stopped at its end rather than asked to unregister its models: the
    loads below can leave TorchServe 0.12's async job map unable to unregister them (``loaded_torchserve``
    in ``test_handlers_on_users_archives.py`` says how), which would leave the session's server unhealthy."""
    with TorchServeProcess(tmp_path_factory.mktemp("torchserve_orca_openai"), model_store_dir) as server:
        yield server


@pytest.fixture(scope="module")
def served(torchserve, model_store_dir, tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("users_chat")
    torch.manual_seed(5)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                                      tie_word_embeddings=False)  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(save_small_tokenizer(folder))
    mar = user_archive(model_store_dir, folder / "work", NAME, "orca",
                       {**ASYNC, "handler": {"orca": {"max_batch": 4, "kv_slots": 4}}},
                       folder / "model.safetensors", [folder / "config.json", *tokenizer_files(folder)])  # fmt: skip
    torchserve.management().register(mar, model_name=NAME)
    client = openai.OpenAI(base_url=f"{torchserve.inference_url}/predictions/{NAME}/1.0/v1", api_key="unused",
                           max_retries=0, timeout=60)  # fmt: skip
    return client, model, tokenizer


def greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """``generate``'s greedy tokens, ended after the first end-of-text as a server ends a request."""
    with torch.inference_mode():
        mask = torch.ones(1, len(prompt_ids), dtype=torch.long)
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=EOS)  # fmt: skip
    ids = out[0, len(prompt_ids) :].tolist()
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


PROMPTS = ["the quick brown", "Once upon a time a small server", "hello world! serving"]


def test_completions_equal_generate_served_together_and_count_their_tokens(served):
    client, model, tokenizer = served
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: client.completions.create(model=NAME, prompt=p, max_tokens=12,
                                                                    temperature=0), PROMPTS))  # fmt: skip
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        ids = tokenizer.encode(prompt)
        expected = greedy(model, ids, 12)
        assert answer.choices[0].text == text_of(tokenizer, expected)
        assert answer.choices[0].finish_reason == ("stop" if expected[-1] == EOS else "length")
        assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == len(expected)
        assert answer.usage.total_tokens == len(ids) + len(expected) and answer.object == "text_completion"


def test_a_streamed_completion_adds_up_to_the_whole_one_and_ends_with_usage(served):
    client, model, tokenizer = served
    whole = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert len(chunks) > 3  # text arrived piece by piece
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_stop_string_ends_the_text_just_before_it_streamed_or_not(served):
    client, model, tokenizer = served
    full = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0).choices[0].text
    # A string from the middle of what greedy decoding writes (random weights write stray bytes: U+FFFD)
    starts = [i for i in range(2, len(full) - 3) if "\ufffd" not in full[i : i + 3]]
    assert starts, full
    stop = full[starts[0] : starts[0] + 3]
    expected = full[: full.index(stop)]
    cut = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=[stop, "§§"])
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 20
    streamed = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=stop,
                                         stream=True)  # fmt: skip
    pieces = [c.choices[0].text for c in streamed]
    assert "".join(pieces) == expected and not any(stop in p for p in pieces)


def test_chat_completions_render_the_template_and_equal_generate(served):
    client, model, tokenizer = served
    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "the lazy dog?"}]
    answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)  # fmt: skip
    expected = greedy(model, prompt, 10)
    assert answer.choices[0].message.role == "assistant" and answer.object == "chat.completion"
    assert answer.choices[0].message.content == text_of(tokenizer, expected)
    assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == len(expected)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


def test_a_seeded_sampled_completion_is_reproducible(served):
    client, _, _ = served
    ask = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 17}
    assert client.completions.create(**ask).choices[0].text == client.completions.create(**ask).choices[0].text


@pytest.mark.parametrize(
    "ask, param, words",
    [
        ({"prompt": "the quick", "max_tokens": 500}, "max_tokens", f"the context holds {CONTEXT}"),
        ({"prompt": "the quick", "n": 2}, "n", "not supported"),
        ({"prompt": "the quick", "extra_body": {"beams": 2}}, "beams", "unrecognized request argument"),
        ({"prompt": "the " * 80}, "prompt", "leaves no room"),
    ],
)
def test_a_bad_request_is_a_400_in_openais_shape_and_the_server_serves_on(served, ask, param, words):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, **ask)
    error = caught.value.body  # the client reads OpenAI's {"error": {...}} and hands over its inside
    assert caught.value.status_code == 400 and error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert client.completions.create(model=NAME, prompt="the", max_tokens=2, temperature=0).choices[0].text is not None


def test_the_models_route_names_the_served_model_and_an_unknown_route_is_a_404(served):
    client, _, _ = served
    assert [m.id for m in client.models.list()] == [NAME]
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model=NAME, input="the quick")
    assert caught.value.body["code"] == "unknown_url" and "/v1/completions" in caught.value.body["message"]


@pytest.fixture(scope="module")
def chunked(served, torchserve, model_store_dir, tmp_path_factory):
    """The same checkpoint archived with chunked prefill (prompts computed 3 tokens per iteration) and KV
    blocks of 4 positions, few enough that long prompts are split across iterations beside decodes."""
    _, model, tokenizer = served
    folder = tmp_path_factory.mktemp("users_chat_chunked")
    model.save_pretrained(folder)
    save_small_tokenizer(folder)
    name = f"{NAME}-chunked"
    settings = {"max_batch": 4, "kv_slots": 4, "block_size": 4, "prefill_chunk": 3}
    mar = user_archive(model_store_dir, folder / "work", name, "orca", {**ASYNC, "handler": {"orca": settings}},
                       folder / "model.safetensors", [folder / "config.json", *tokenizer_files(folder)])  # fmt: skip
    torchserve.management().register(mar, model_name=name)
    client = openai.OpenAI(base_url=f"{torchserve.inference_url}/predictions/{name}/1.0/v1", api_key="unused",
                           max_retries=0, timeout=60)  # fmt: skip
    return client, name


def test_chunked_prefill_answers_prompts_of_every_length_served_together_as_generate_does(served, chunked):
    _, model, tokenizer = served
    client, name = chunked
    prompts = [*PROMPTS, "a", "a longer prompt across chunks and blocks"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: client.completions.create(model=name, prompt=p, max_tokens=10,
                                                                    temperature=0), prompts))  # fmt: skip
    assert len(tokenizer.encode(prompts[-1])) > 3 * 3  # the long one takes several prefill iterations
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = tokenizer.encode(prompt)
        assert answer.choices[0].text == text_of(tokenizer, greedy(model, ids, 10)), prompt
        assert answer.usage.prompt_tokens == len(ids)


# Eight prompts of different lengths, for the loads below: twice as many clients as the archive's KV slots.
LOAD_PROMPTS = [*PROMPTS, "a", "serving under load", "the lazy dog sleeps", "seven", "one more prompt of words"]


def test_under_eight_clients_and_a_poisson_rate_every_completion_is_answered_and_equals_generate(served, torchserve):
    """The loads users make, on the route they use: eight clients that each wait for their answer before
    asking again (twice the archive's four KV slots, so requests queue for a slot), a third of them streamed,
    each answer its own prompt's greedy one; then Poisson arrivals at 60 a second for 2 s, sent whether or
    not the last were answered: every one answered 200, none lost."""
    client, model, tokenizer = served
    asks = [(LOAD_PROMPTS[(k + j) % 8], (4, 9)[(k + j) % 2], (k + j) % 3 == 0) for k in range(8) for j in range(4)]
    expected = {(p, n): text_of(tokenizer, greedy(model, tokenizer.encode(p), n)) for p, n, _ in asks}

    def ask(prompt: str, n: int, stream: bool) -> str:
        answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=stream)
        return "".join(c.choices[0].text for c in answer) if stream else answer.choices[0].text

    def one_client(k: int) -> list[str]:  # four requests in turn
        return [ask(*a) for a in asks[4 * k : 4 * k + 4]]

    with ThreadPoolExecutor(8) as pool:
        texts = [text for answers in pool.map(one_client, range(8)) for text in answers]
    assert len(texts) == len(asks)
    wrong = [(p, n, s, t) for (p, n, s), t in zip(asks, texts, strict=True) if t != expected[(p, n)]]
    assert wrong == [], wrong[:3]

    url = f"{torchserve.inference_url}/predictions/{NAME}/1.0/v1/completions"
    body = {"model": NAME, "max_tokens": 6, "temperature": 0}
    result = run(open_loop(url, lambda i: {**body, "prompt": LOAD_PROMPTS[i % 8]}, [(2.0, 60.0)], seed=4))
    assert len(result.samples) >= 80 and result.failed == 0, [s.status for s in result.samples if s.status != 200]

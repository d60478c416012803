"""Orca served by a real TorchServe: GPT-2 tokens, streamed and not, equal to greedy decoding."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import torch

from archiver.build import build_archive
from archiver.options import ServingOptions
from model_store.catalog import get_spec
from model_store.factory import build_model
from model_store.samples import request_body

pytestmark = pytest.mark.torchserve

ORCA_TEST_SETTINGS = {"max_batch": 4, "kv_slots": 4, "max_tokens": 64, "max_new_tokens": 32, "default_new_tokens": 4}
MODEL = "gpt2-orca"


@pytest.fixture(scope="module")
def orca(torchserve, model_store_dir):
    options = ServingOptions(handler="orca", handler_settings=tuple(ORCA_TEST_SETTINGS.items()))
    path = build_archive(get_spec("gpt2"), model_store_dir, options)
    torchserve.management().register(path.name, model_name=MODEL, initial_workers=1)
    yield f"{torchserve.inference_url}/predictions/{MODEL}"
    torchserve.management().unregister(MODEL)


@pytest.fixture(scope="module")
def reference():
    hf = build_model(get_spec("gpt2")).model

    def greedy(prompt: list[int], new_tokens: int) -> list[int]:
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(new_tokens):
                ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    return greedy


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 50257, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _post(session: aiohttp.ClientSession, url: str, delay: float, payload: object) -> dict:
    await asyncio.sleep(delay)
    data = request_body(payload)
    sent = time.monotonic()
    chunks: list[tuple[float, bytes]] = []
    async with session.post(url, data=data) as resp:
        async for chunk in resp.content.iter_any():
            chunks.append((time.monotonic() - sent, chunk))
        status = resp.status
    body = b"".join(c for _, c in chunks)
    return {"status": status, "body": body.decode(), "chunks": chunks, "done": time.monotonic()}


def post(url: str, sends: list[tuple[float, object]]) -> list[dict]:
    async def run() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            return list(await asyncio.gather(*(_post(session, url, d, p) for d, p in sends)))

    return asyncio.run(run())


def test_answers_equal_greedy_decoding_and_bad_requests_get_their_400(orca, reference):
    good = [{"input_ids": ids(1, 7), "max_new_tokens": 6}, {"input_ids": ids(2, 20)}, {"input_ids": [464]}]
    bad = [
        (b"{not json", "malformed JSON"),
        ({"input_ids": [1, 50257]}, "outside the vocabulary"),
        ({"input_ids": ids(3, 40), "max_new_tokens": 30}, "exceeds the 64 tokens"),
        ({"input_ids": [1], "max_new_tokens": 0}, "1..32"),
        ({"input_ids": [1], "temperature": -0.5}, "temperature must be in"),
        ({"input_ids": [1], "temperature": 1.0, "top_p": 2}, "top_p must be in"),
        ({"input_ids": [1], "beam_width": 4}, "unknown fields"),
        ({"input_ids": [1], "stop_token_ids": [50257]}, "outside the vocabulary"),
        ({"input_ids": []}, "empty"),
        ([1, 2, 3], "JSON object"),
    ]
    answers = post(orca, [(0.0, p) for p in good] + [(0.0, p) for p, _ in bad])
    assert [a["status"] for a in answers] == [200] * 3 + [400] * len(bad), [a["body"] for a in answers]
    for answer, (_, reason) in zip(answers[3:], bad, strict=True):
        assert reason in json.loads(answer["body"])["message"]
    expected = [reference(good[0]["input_ids"], 6), reference(good[1]["input_ids"], 4), reference([464], 4)]
    assert [json.loads(a["body"])["output_ids"] for a in answers[:3]] == expected


def test_a_seeded_sampled_request_is_answered_the_same_twice_and_unseeded_ones_differ(orca):
    seeded = {"input_ids": ids(4, 5), "max_new_tokens": 8, "temperature": 1.0, "top_k": 50, "seed": 123}
    unseeded = {"input_ids": ids(4, 5), "max_new_tokens": 8, "temperature": 1.5}
    answers = post(orca, [(0.0, seeded), (0.0, {"input_ids": ids(5, 9)}), (0.2, seeded)] + [(0.0, unseeded)] * 3)
    assert [a["status"] for a in answers] == [200] * 6, [a["body"] for a in answers]
    outputs = [json.loads(a["body"])["output_ids"] for a in answers]
    assert outputs[0] == outputs[2] and len(outputs[0]) == 8
    assert len({tuple(o) for o in outputs[3:]}) > 1


def test_streamed_tokens_arrive_one_by_one_and_equal_greedy_decoding(orca, reference):
    prompt = ids(4, 5)
    (answer,) = post(orca, [(0.0, {"input_ids": prompt, "max_new_tokens": 8, "stream": True})])
    assert answer["status"] == 200
    lines = [json.loads(line) for line in answer["body"].splitlines() if line.strip()]
    assert [line["index"] for line in lines] == list(range(8))
    expected = reference(prompt, 8)
    assert [line["token"] for line in lines] == expected
    assert lines[-1]["finished"] is True and lines[-1]["output_ids"] == expected
    assert len(answer["chunks"]) >= 2  # sent as they were made, not as one body at the end


def test_a_late_short_request_is_answered_before_an_earlier_long_one(orca, reference):
    long_prompt, short_prompt = ids(5, 6), ids(6, 6)
    long, short = post(orca, [(0.0, {"input_ids": long_prompt, "max_new_tokens": 30}),
                              (0.5, {"input_ids": short_prompt, "max_new_tokens": 2})])  # fmt: skip
    assert long["status"] == short["status"] == 200
    assert short["done"] < long["done"]  # joined the running batch and left as soon as it was done
    assert json.loads(short["body"])["output_ids"] == reference(short_prompt, 2)
    assert json.loads(long["body"])["output_ids"] == reference(long_prompt, 30)


def test_the_builder_refuses_what_orca_cannot_serve(tmp_path):
    from handlers.orca.config import OrcaConfigError

    options = ServingOptions(handler="orca")
    with pytest.raises(ValueError, match="GPT-2 and Llama-family models in eager mode"):
        build_archive(get_spec("bert-mini"), tmp_path, options)
    with pytest.raises(ValueError, match="GPT-2 and Llama-family models in eager mode"):
        build_archive(get_spec("gpt2", "script"), tmp_path, options)
    with pytest.raises(ValueError, match="decode_threads"):
        ServingOptions(handler="orca", decode_threads=2)
    for raw, message in [({"max_tokens": 2048}, "1024"), ({"max_new_tokens": 300}, "room for a prompt"),
                         ({"kv_slots": 0}, "kv_slots"), ({"beam": 2}, "unknown orca settings")]:  # fmt: skip
        with pytest.raises(OrcaConfigError, match=message):
            ServingOptions(handler="orca", handler_settings=tuple(raw.items()))


def test_a_body_over_the_archives_limit_is_a_413_before_it_is_parsed():
    from handlers.errors import RequestError
    from handlers.orca.config import OrcaConfig
    from handlers.orca.handler import parse_generation_request

    body = json.dumps({"input_ids": [1] * 100}).encode()
    with pytest.raises(RequestError, match="exceeds the limit of 64 bytes") as err:
        parse_generation_request({"body": body}, OrcaConfig(), max_payload_bytes=64)
    assert err.value.status == 413
    assert parse_generation_request({"body": body}, OrcaConfig(), max_payload_bytes=len(body))[0] == [1] * 100

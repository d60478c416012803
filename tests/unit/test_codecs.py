"""Request decoding and validation, without a server."""

import json
import math
import re

import pytest
import torch

from archiver.options import ServingOptions, model_config
from handlers.codecs import InputCodec, answer_bytes, collate, encode_output, widen_tokens
from handlers.errors import RequestError
from model_store.catalog import get_spec
from tests.payloads import image_tensor_json, jpeg_bytes, png_bytes, token_ids_json

RESNET = get_spec("resnet50")
BERT = get_spec("bert-base")
INCEPTION = get_spec("inception_v3")


def refused(codec: InputCodec, row: dict) -> RequestError:
    with pytest.raises(RequestError) as info:
        codec.decode(row)
    return info.value


@pytest.mark.parametrize("spec", [RESNET, INCEPTION])
def test_images_decode_to_the_model_input_shape(spec):
    codec = InputCodec(spec)
    for payload in (jpeg_bytes(), png_bytes(), bytearray(jpeg_bytes(1))):
        (tensor,) = codec.decode({"body": payload}).tensors
        assert tuple(tensor.shape) == spec.image_shape
        assert tensor.dtype == torch.float32


def test_json_tensor_is_taken_verbatim_from_bytes_dict_or_form_field():
    codec = InputCodec(RESNET)
    payload = image_tensor_json(RESNET, seed=3)
    expected = torch.tensor(payload["data"])
    for row in ({"body": payload}, {"body": json.dumps(payload).encode()}, {"data": json.dumps(payload)}):
        (tensor,) = codec.decode(row).tensors
        assert torch.equal(tensor, expected)


def test_tokens_are_padded_with_a_mask():
    codec = InputCodec(BERT)
    ids, mask = codec.decode({"body": {"input_ids": [5, 6, 7]}}).tensors
    assert ids.shape == mask.shape == (BERT.seq_len,)
    assert ids[:3].tolist() == [5, 6, 7] and ids[3:].sum() == 0
    assert mask.sum() == 3


def test_declared_token_lengths_pad_each_request_to_its_length_class():
    codec = InputCodec(BERT, token_lengths=[64, 16])
    assert codec.token_lengths == (16, 64, BERT.seq_len)  # sorted, the sequence length added
    for n, padded in [(1, 16), (16, 16), (17, 64), (64, 64), (65, BERT.seq_len), (BERT.seq_len, BERT.seq_len)]:
        ids, mask = codec.decode({"body": {"input_ids": list(range(1, n + 1))}}).tensors
        assert ids.shape == mask.shape == (padded,), n
        assert ids[:n].tolist() == list(range(1, n + 1)) and int(mask.sum()) == n


def test_a_token_request_widened_to_a_longer_class_is_the_same_request_with_more_padding():
    codec = InputCodec(BERT, token_lengths=[16, 64])
    item = codec.decode({"body": {"input_ids": [5, 6, 7]}})
    wide = widen_tokens(item, 64)
    assert wide.shapes == ((64,), (64,)) and wide.v2 is item.v2
    assert wide.rows[0][:16] == item.rows[0] and wide.rows[1][:16] == item.rows[1]
    assert sum(wide.rows[1]) == 3 and sum(wide.rows[0][16:]) == 0
    assert widen_tokens(item, 16) is item
    with pytest.raises(ValueError, match="cannot widen 16 tokens to 8"):
        widen_tokens(item, 8)


@pytest.mark.parametrize("lengths", [[0], [BERT.seq_len + 1], ["16"], [True], "16,64", [2.5]])
def test_bad_token_lengths_are_refused(lengths):
    with pytest.raises(ValueError, match="token_lengths"):
        InputCodec(BERT, token_lengths=lengths)


def test_token_lengths_do_not_apply_to_images():
    with pytest.raises(ValueError, match="token_lengths"):
        InputCodec(get_spec("resnet50"), token_lengths=[16])
    with pytest.raises(ValueError, match="token_lengths apply to token models"):
        model_config(get_spec("resnet50"), ServingOptions(handler="dvabatch", token_lengths=(16,)))
    with pytest.raises(ValueError, match="token_lengths applies to async handlers"):
        ServingOptions(token_lengths=(16,))
    config = model_config(BERT, ServingOptions(handler="dvabatch", token_lengths=(64, 16)))
    assert config["handler"]["token_lengths"] == [16, 64, BERT.seq_len]


def test_collate_stacks_each_position():
    codec = InputCodec(BERT)
    rows = [{"body": token_ids_json(BERT, n, seed=n)} for n in (3, 9)]
    ids, mask = collate([codec.decode(r) for r in rows])
    assert ids.shape == (2, BERT.seq_len) and mask.sum(1).tolist() == [3, 9]


@pytest.mark.parametrize(
    "spec, row, status, reason",
    [
        (RESNET, {"body": b""}, 400, "empty request body"),
        (RESNET, {"body": None}, 400, "empty request body"),
        (RESNET, {"body": b'{"data": [1, 2'}, 400, "malformed JSON"),
        (RESNET, {"body": {"data": [[1.0, 2.0]]}}, 400, r"wrong tensor shape \[1, 2\], expected \[3, 224, 224\]"),
        (RESNET, {"body": {"data": [["a", "b"]]}}, 400, "wrong dtype"),
        (RESNET, {"body": {"data": [[1.0], [1.0, 2.0]]}}, 400, "ragged shape"),
        (RESNET, {"body": {"pixels": []}}, 400, "needs a 'data' field"),
        (RESNET, {"body": b"\xff\xd8\xff" + b"\x00" * 64}, 415, "cannot decode image"),
        (RESNET, {"body": b"GIF89a\x00\x01\xfe\xff"}, 415, "neither JSON nor a JPEG/PNG"),
        (RESNET, {"body": b"x" * (8 * 1024 * 1024 + 1)}, 413, "exceeds the limit"),
        (RESNET, {"a": b"1", "b": b"2"}, 400, "expected one payload field"),
        (BERT, {"body": {"input_ids": []}}, 400, "non-empty list"),
        (BERT, {"body": {"input_ids": [1.5, 2]}}, 400, "wrong dtype"),
        (BERT, {"body": {"input_ids": [True]}}, 400, "wrong dtype"),
        (BERT, {"body": {"input_ids": [1] * 129}}, 400, "exceed the model's sequence length 128"),
        (BERT, {"body": {"input_ids": [30522]}}, 400, "outside the vocabulary"),
        (BERT, {"body": {"input_ids": [-1]}}, 400, "outside the vocabulary"),
        (BERT, {"body": {"text": "hi"}}, 400, "needs an 'input_ids' list"),
    ],
)
def test_bad_requests_get_a_4xx_and_a_one_line_reason(spec, row, status, reason):
    err = refused(InputCodec(spec), row)
    assert err.status == status
    assert "\n" not in err.reason
    assert re.search(reason, err.reason), err.reason
    body = json.loads(err.body())
    assert body["code"] == status and body["message"] == err.reason


def test_nan_is_refused():
    data = image_tensor_json(RESNET)
    data["data"][0][0][0] = float("nan")
    assert "NaN" in refused(InputCodec(RESNET), {"body": data}).reason


def test_an_answer_is_compact_json_bytes_even_with_non_finite_logits():
    row = torch.tensor([0.5, float("nan"), float("inf"), -1.25, 2.0, 0.0])
    body = answer_bytes(encode_output(row))
    assert isinstance(body, bytes) and b" " not in body and b"\n" not in body
    answer = json.loads(body)  # strict JSON: no NaN or Infinity
    assert answer["logits"] == [0.5, None, None, -1.25, 2.0, 0.0]
    assert all(entry["logit"] is None or math.isfinite(entry["logit"]) for entry in answer["top5"])


def test_a_segmentation_answer_is_the_mask_of_each_pixels_likeliest_class():
    row = torch.zeros(3, 2, 4)
    row[1, 0, :] = 1.0  # top row: class 1
    row[2, 1, 3] = 5.0  # one pixel: class 2
    answer = json.loads(answer_bytes(encode_output(row)))
    assert answer == {"classes": 3, "mask": [[1, 1, 1, 1], [0, 0, 0, 2]]}
    with pytest.raises(ValueError, match="shape"):
        encode_output(torch.zeros(2, 2))

"""The Open Inference Protocol's wire format, against tritonclient's own encoder and decoder."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving_harness import oip
from serving_harness.oip_grpc import input_bytes, message_class

httpclient = pytest.importorskip("tritonclient.http")
service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")

NUMERIC = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"]


def sample(datatype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if datatype == "BYTES":
        out = np.empty(int(np.prod(shape)), dtype=object)
        out[:] = [bytes(rng.integers(0, 256, rng.integers(0, 9)).astype(np.uint8)) for _ in range(out.size)]
        return out.reshape(shape)
    if datatype == "BOOL":
        return rng.random(shape) < 0.5
    dtype = oip.DTYPES[datatype]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


def triton_body(inputs: list[tuple[str, np.ndarray, str]], binary: bool, **kwargs) -> bytes:
    items = []
    for name, array, datatype in inputs:
        item = httpclient.InferInput(name, list(array.shape), datatype)
        item.set_data_from_numpy(array, binary_data=binary)
        items.append(item)
    body, _ = httpclient.InferenceServerClient.generate_request_body(items, **kwargs)
    return body


# tritonclient sends FP16 in binary only.
WIRE_CASES = [(d, b) for d in [*NUMERIC, "BYTES"] for b in (True, False) if not (d == "FP16" and not b)]


@pytest.mark.parametrize(("datatype", "binary"), WIRE_CASES)
def test_tritonclients_request_parses_to_the_same_tensors(datatype, binary):
    if datatype == "BYTES" and not binary:
        array = np.array([b"ab", b"", "é".encode()], dtype=object).reshape(1, 3)  # JSON BYTES are UTF-8 text
    else:
        array = sample(datatype, (2, 3), seed=len(datatype))
    request = oip.parse_request(triton_body([("x", array, datatype), ("y", sample("FP32", (4,)), "FP32")], binary,
                                            request_id="r1"))  # fmt: skip
    assert request.id == "r1" and list(request.inputs) == ["x", "y"]
    got = request.inputs["x"]
    assert got.datatype == datatype and got.shape == array.shape
    assert got.array.tolist() == array.tolist()
    assert request.binary_output  # tritonclient asks for binary outputs when it names none


def test_a_json_request_may_nest_its_data_and_name_its_outputs():
    nested = {"name": "a", "datatype": "INT32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}
    request = oip.parse_request({"inputs": [nested], "outputs": [{"name": "logits"}]})
    assert request.inputs["a"].array.tolist() == [[1, 2], [3, 4]] and request.outputs == ("logits",)
    assert not request.binary_output


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [3], "data": [1, 2]}]}, "input 'a': 2 values for"),
        ({"inputs": [{"name": "a", "datatype": "BF16", "shape": [1], "data": [1]}]}, "input 'a': datatype 'BF16'"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [-1], "data": []}]}, "input 'a': 'shape' must be"),
        ({"inputs": [{"name": "a", "datatype": "INT8", "shape": [1], "data": [128]}]}, "128 does not fit INT8"),
        ({"inputs": [{"name": "a", "datatype": "INT64", "shape": [1], "data": [1.5]}]}, "INT64 data must be integers"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1]}]}, "input 'a' carries no data"),
        ({"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}, "input #0 needs a 'name'"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}] * 2}, "input 'a' is given twice"),
        ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [10**9], "data": []}]}, "over the limit"),
        ({"inputs": []} | {"outputs": [{"id": 1}]}, "'outputs' must be a list of objects"),
    ],
)
def test_a_malformed_request_is_refused_naming_the_input(body, reason):
    with pytest.raises(oip.OipError) as refused:
        oip.parse_request(json.dumps(body).encode())
    assert reason in str(refused.value)


def test_binary_data_that_does_not_add_up_is_refused():
    good = triton_body([("x", sample("FP32", (4,)), "FP32")], binary=True)
    with pytest.raises(oip.OipError, match="input 'x': binary_data_size 16 but 12 bytes"):
        oip.parse_request(good[:-4])
    with pytest.raises(oip.OipError, match="3 bytes of binary data follow the inputs that no input claims"):
        oip.parse_request(good + b"xyz")
    with pytest.raises(oip.OipError, match="input 'x': a BYTES element claims 99 bytes"):
        oip.parse_request(oip.binary_request([("x", "BYTES", [1], b"\x63\x00\x00\x00ab")])[0])


def test_a_missing_input_is_named_with_what_the_request_has():
    request = oip.parse_request({"inputs": [{"name": "b", "datatype": "FP32", "shape": [1], "data": [0.5]}]})
    with pytest.raises(oip.OipError, match=r"missing input 'a' \(the request has \['b'\]\)"):
        request.get("a")


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=20), st.booleans())
def test_a_response_reads_back_in_tritonclient_as_it_was_sent(values, as_bytes):
    logits = np.asarray(values, dtype=np.float32).reshape(1, -1)
    labels = np.array([b"cat", b"dog"], dtype=object)
    outputs = [("logits", logits)] + ([("label", labels)] if as_bytes else [])
    result = httpclient.InferResult.from_response_body(oip.response_body("m", outputs, "7"))
    np.testing.assert_array_equal(result.as_numpy("logits"), logits)
    assert result.get_response()["id"] == "7"
    if as_bytes:
        assert [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("label")] == ["cat", "dog"]


def test_non_finite_outputs_travel_as_null_and_read_back_as_nan():
    body = oip.response_body("m", [("logits", np.array([1.0, np.inf, np.nan], dtype=np.float32))])
    assert json.loads(body)["outputs"][0]["data"] == [1.0, None, None]
    _, (tensor,) = oip.parse_response(body)
    assert tensor.array[0] == 1.0 and np.isnan(tensor.array[1:]).all()


def test_asking_for_an_output_the_model_lacks_is_refused():
    request = oip.InferRequest({}, outputs=("scores",))
    with pytest.raises(oip.OipError, match=r"unknown output 'scores' \(the model answers \['logits'\]\)"):
        oip.select_outputs(request, [("logits", np.zeros(2))])


def test_the_binary_form_round_trips_every_datatype():
    inputs = [(d, d, (2, 2), oip.binary_bytes(sample(d, (2, 2), seed=i), d)) for i, d in enumerate([*NUMERIC, "BYTES"])]
    body, header_length = oip.binary_request(inputs, "id-1", ["logits"], {"priority": 1})
    assert json.loads(body[:header_length])["parameters"] == {"priority": 1}
    request = oip.parse_request(body)
    for i, d in enumerate([*NUMERIC, "BYTES"]):
        assert request.inputs[d].array.tolist() == sample(d, (2, 2), seed=i).tolist()


# -- the gRPC messages, against tritonclient's generated ones ------------------------------------


def test_the_grpc_request_tritonclient_sends_parses_into_ours_field_for_field():
    import tritonclient.grpc as grpcclient

    x = sample("FP32", (1, 6))
    item = grpcclient.InferInput("image", [1, 6], "FP32")
    item.set_data_from_numpy(x)
    theirs = service_pb2.ModelInferRequest(model_name="m", model_version="2", id="r")
    theirs.inputs.extend([item._get_tensor()])
    theirs.raw_input_contents.extend([item._get_content()])
    theirs.outputs.add(name="logits")
    theirs.parameters["priority"].int64_param = 3
    ours = message_class("ModelInferRequest").FromString(theirs.SerializeToString())
    assert (ours.model_name, ours.model_version, ours.id) == ("m", "2", "r")
    assert [(t.name, t.datatype, list(t.shape)) for t in ours.inputs] == [("image", "FP32", [1, 6])]
    assert ours.outputs[0].name == "logits" and ours.parameters["priority"].int64_param == 3
    raw = input_bytes(ours.inputs[0], list(ours.raw_input_contents), 0)
    assert np.frombuffer(raw, np.float32).tolist() == x.ravel().tolist()


def test_typed_contents_are_packed_as_the_binary_extension_lays_them_out():
    theirs = service_pb2.ModelInferRequest(model_name="m")
    tensor = theirs.inputs.add(name="ids", datatype="INT64", shape=[3])
    tensor.contents.int64_contents.extend([1, -2, 3])
    words = theirs.inputs.add(name="w", datatype="BYTES", shape=[2])
    words.contents.bytes_contents.extend([b"a", b"bc"])
    ours = message_class("ModelInferRequest").FromString(theirs.SerializeToString())
    assert np.frombuffer(input_bytes(ours.inputs[0], [], 0), "<i8").tolist() == [1, -2, 3]
    assert input_bytes(ours.inputs[1], [], 1) == b"\x01\x00\x00\x00a\x02\x00\x00\x00bc"


def test_our_responses_parse_in_tritonclients_messages():
    ours = message_class("ModelInferResponse")(model_name="m", id="r")
    ours.outputs.add(name="logits", datatype="FP32", shape=[1, 2])
    ours.raw_output_contents.append(np.array([1.5, -2.0], np.float32).tobytes())
    theirs = service_pb2.ModelInferResponse.FromString(ours.SerializeToString())
    assert theirs.outputs[0].name == "logits" and list(theirs.outputs[0].shape) == [1, 2]
    assert np.frombuffer(theirs.raw_output_contents[0], np.float32).tolist() == [1.5, -2.0]
    meta = message_class("ModelMetadataResponse")(name="m", versions=["1"], platform="pytorch")
    meta.inputs.add(name="image", datatype="FP32", shape=[1, 3, 224, 224])
    parsed = service_pb2.ModelMetadataResponse.FromString(meta.SerializeToString())
    assert parsed.inputs[0].name == "image" and list(parsed.inputs[0].shape) == [1, 3, 224, 224]
    for name, field in (("ServerLive", "live"), ("ServerReady", "ready"), ("ModelReady", "ready")):
        wire = message_class(f"{name}Response")(**{field: True}).SerializeToString()
        assert getattr(getattr(service_pb2, f"{name}Response").FromString(wire), field) is True

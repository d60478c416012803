"""The Open Inference Protocol (KServe v2) through a real TorchServe, with tritonclient as the client.

tritonclient is nobody here's code: its HTTP client sends tensors in the binary
extension by default (JSON with ``binary_data=False``), its gRPC client sends
``raw_input_contents`` to the standard ``inference.GRPCInferenceService``,
which Packrat's gRPC front serves in front of TorchServe's HTTP side.
"""

from __future__ import annotations

import joblib
import numpy as np
import pytest
import torch
from sklearn.compose import ColumnTransformer
from sklearn.ensemble import RandomForestClassifier
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from model_store.catalog import get_spec
from serving_harness.oip_grpc import OipGrpcFront
from tests.payloads import jpeg_bytes, reference_logits
from windtunnel.archive import build_sklearn_archive
from windtunnel.datasets import synthetic_tabular

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def front(torchserve):
    with OipGrpcFront(torchserve.inference_url, torchserve.management_url, port=0) as grpc_front:
        yield grpc_front


@pytest.fixture(scope="module")
def http(torchserve):
    return httpclient.InferenceServerClient(torchserve.inference_url.removeprefix("http://"))


@pytest.fixture(scope="module")
def grpc(front):
    return grpcclient.InferenceServerClient(f"127.0.0.1:{front.port}")


def tensor(module, name: str, array: np.ndarray, datatype: str, binary: bool = True):
    item = module.InferInput(name, list(array.shape), datatype)
    if module is httpclient:
        item.set_data_from_numpy(array, binary_data=binary)
    else:
        item.set_data_from_numpy(array)
    return item


def image_array(seed: int) -> np.ndarray:
    return torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(seed)).numpy()


def test_health_and_metadata_answer_over_http_and_grpc(served, http, grpc):
    model = served("resnet50", "eager")
    assert http.is_server_live() and http.is_server_ready()
    assert grpc.is_server_live() and grpc.is_server_ready() and grpc.is_model_ready(model)
    metadata = grpc.get_model_metadata(model, as_json=True)
    assert metadata["name"] == model
    assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in metadata["inputs"]] == [
        ("image", "FP32", [1, 3, 224, 224])
    ]
    assert [t["name"] for t in metadata["outputs"]] == ["logits"]
    with pytest.raises(InferenceServerException, match="not found|Model not found|NOT_FOUND"):
        grpc.get_model_metadata("no-such-model")


@pytest.mark.parametrize("protocol", ["http-binary", "http-json", "grpc"])
def test_resnet50_answers_equal_the_model_over_each_wire(served, http, grpc, protocol):
    spec = get_spec("resnet50", "eager")
    model = served("resnet50", "eager")
    x = image_array(seed=11)
    expected = reference_logits(spec, [{"body": {"data": x[0].tolist()}}]).numpy()
    client, module = (grpc, grpcclient) if protocol == "grpc" else (http, httpclient)
    result = client.infer(model, [tensor(module, "image", x, "FP32", binary=protocol != "http-json")],
                          request_id="req-7")  # fmt: skip
    logits = result.as_numpy("logits")
    assert logits.shape == (1, 1000) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, expected, atol=TOL, rtol=TOL)
    response = result.get_response(as_json=True) if protocol == "grpc" else result.get_response()
    assert response["id"] == "req-7"


@pytest.mark.parametrize("handler", ["ebird", "dvabatch"])
def test_the_scheduling_handlers_answer_v2_as_the_model_does(served, http, grpc, handler):
    spec = get_spec("resnet50", "eager")
    model = served("resnet50", "eager", handler=handler)
    x = image_array(seed=12)
    expected = reference_logits(spec, [{"body": {"data": x[0].tolist()}}]).numpy()
    for client, module in ((http, httpclient), (grpc, grpcclient)):
        result = client.infer(model, [tensor(module, "image", x, "FP32")])
        np.testing.assert_allclose(result.as_numpy("logits"), expected, atol=TOL, rtol=TOL)
    with pytest.raises(InferenceServerException, match="input 'image': shape"):
        http.infer(model, [tensor(httpclient, "image", x[:, :, :100], "FP32")])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_jpeg_as_bytes_is_decoded_as_the_handler_decodes_any_jpeg(served, http, grpc, protocol):
    spec = get_spec("resnet50", "eager")
    model = served("resnet50", "eager")
    raw = jpeg_bytes(seed=4)
    expected = reference_logits(spec, [{"body": raw}]).numpy()
    client, module = (grpc, grpcclient) if protocol == "grpc" else (http, httpclient)
    result = client.infer(model, [tensor(module, "image", np.array([raw], dtype=object), "BYTES")])
    np.testing.assert_allclose(result.as_numpy("logits"), expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bert_answers_equal_the_model_with_and_without_a_mask(served, http, grpc, protocol):
    spec = get_spec("bert-mini", "eager")
    model = served("bert-mini", "eager")
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(3)).numpy().astype(np.int64)
    expected = reference_logits(spec, [{"body": {"input_ids": ids[0].tolist()}}]).numpy()
    client, module = (grpc, grpcclient) if protocol == "grpc" else (http, httpclient)
    alone = client.infer(model, [tensor(module, "input_ids", ids, "INT64")])
    np.testing.assert_allclose(alone.as_numpy("logits"), expected, atol=TOL, rtol=TOL)
    padded = np.concatenate([ids, np.zeros((1, 4), dtype=np.int64)], axis=1)
    mask = (np.arange(16) < 12).astype(np.int64)[None]
    masked = client.infer(model, [tensor(module, "input_ids", padded.astype(np.int32), "INT32"),
                                  tensor(module, "attention_mask", mask, "INT64")])  # fmt: skip
    np.testing.assert_allclose(masked.as_numpy("logits"), expected, atol=TOL, rtol=TOL)


BAD_TENSORS = [
    ("resnet50", [("image", np.zeros((1, 3, 224, 224), np.int64), "INT64")], "input 'image': datatype INT64"),
    ("resnet50", [("image", np.zeros((1, 3, 224, 225), np.float32), "FP32")], "input 'image': shape [1, 3, 224, 225]"),
    ("resnet50", [("image", np.zeros((2, 3, 224, 224), np.float32), "FP32")], "input 'image': a batch of 2"),
    ("resnet50", [("pixels", np.zeros((1, 3, 224, 224), np.float32), "FP32")], "unknown input 'pixels'"),
    ("bert-mini", [("attention_mask", np.ones((1, 4), np.int64), "INT64")], "missing input 'input_ids'"),
    ("bert-mini", [("input_ids", np.zeros((1, 4), np.float32), "FP32")], "input 'input_ids': datatype FP32"),
    ("bert-mini", [("input_ids", np.full((1, 4), 10**6, np.int64), "INT64")], "input 'input_ids': token id 1000000"),
]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(("name", "inputs", "reason"), BAD_TENSORS, ids=[r for *_, r in BAD_TENSORS])
def test_a_bad_tensor_is_refused_naming_the_input_and_the_server_serves_on(served, http, grpc, protocol, name,
                                                                           inputs, reason):  # fmt: skip
    model = served(name, "eager")
    client, module = (grpc, grpcclient) if protocol == "grpc" else (http, httpclient)
    with pytest.raises(InferenceServerException) as refused:
        client.infer(model, [tensor(module, n, a, d) for n, a, d in inputs])
    assert reason in refused.value.message(), refused.value
    assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), refused.value.status()
    if name == "resnet50":  # the server serves on, over both wires, and the handler's own JSON is unchanged
        good = client.infer(model, [tensor(module, "image", image_array(seed=1), "FP32")])
        assert good.as_numpy("logits").shape == (1, 1000)


def test_the_existing_formats_answer_as_before_beside_v2(served, torchserve, http):
    model = served("resnet50", "eager")
    http.infer(model, [tensor(httpclient, "image", image_array(seed=2), "FP32")])
    answer = torchserve.inference().predict(model, jpeg_bytes(seed=2))
    assert answer.status == 200 and {"top5", "logits"} <= set(answer.body), answer.body


@pytest.fixture(scope="module")
def pipeline_model(torchserve, tmp_path_factory):
    table = synthetic_tabular(400, seed=2)
    columns = ColumnTransformer([("num", StandardScaler(), table.numeric),
                                 ("cat", OneHotEncoder(handle_unknown="error"), table.categorical)])  # fmt: skip
    pipeline = Pipeline([("columns", columns), ("model", RandomForestClassifier(20, max_depth=5, random_state=0))])
    pipeline.fit(table.X[:300], table.y[:300])
    path = tmp_path_factory.mktemp("oip") / "wt_oip.joblib"
    joblib.dump(pipeline, path)
    build_sklearn_archive(path, torchserve.model_store, "wt_oip", columns=table.columns, max_rows=64)
    torchserve.management().register("wt_oip.mar", model_name="wt_oip")
    return "wt_oip", pipeline, table


def column_inputs(module, table, lo: int, hi: int) -> list:
    inputs = []
    for j, name in enumerate(table.columns):
        values = table.X[lo:hi, j]
        if j in table.categorical:
            inputs.append(tensor(module, name, np.array([str(v).encode() for v in values], dtype=object), "BYTES"))
        else:
            inputs.append(tensor(module, name, values.astype(np.float64), "FP64"))
    return inputs


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_windtunnel_pipeline_answers_its_own_probabilities_one_tensor_per_column(pipeline_model, http, grpc,
                                                                                    protocol):  # fmt: skip
    name, pipeline, table = pipeline_model
    client, module = (grpc, grpcclient) if protocol == "grpc" else (http, httpclient)
    result = client.infer(name, column_inputs(module, table, 300, 340))
    np.testing.assert_allclose(result.as_numpy("probabilities"), pipeline.predict_proba(table.X[300:340]), atol=1e-9)
    labels = [int(v.decode() if isinstance(v, bytes) else v) for v in result.as_numpy("label")]
    assert labels == pipeline.predict(table.X[300:340]).tolist()
    if protocol == "grpc":
        metadata = grpc.get_model_metadata(name, as_json=True)
        assert [t["name"] for t in metadata["inputs"]] == list(table.columns)
    bad = column_inputs(module, table, 300, 302)
    region = table.columns[table.categorical[0]]
    bad[table.categorical[0]] = tensor(module, region, np.array([b"mars", b"venus"], dtype=object), "BYTES")
    with pytest.raises(InferenceServerException, match="unknown category 'mars'"):
        client.infer(name, bad)
    with pytest.raises(InferenceServerException, match=f"missing input '{table.columns[0]}'"):
        client.infer(name, column_inputs(module, table, 300, 302)[1:])

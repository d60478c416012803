"""The plain (Packrat) handler object driven directly, as TorchServe's sync worker drives it.

Without a Packrat slot it runs the model where TorchServe's ``BaseHandler``
would: on the GPU TorchServe assigned the worker, else on the CPU.  This is
how its device path is tested where there is a GPU but no Java.
"""

from __future__ import annotations

import json

import pytest
import torch

from archiver.options import ServingOptions
from bench.direct import call_batch, load_context, model_dir_for
from handlers.plain_handler import PlainModelHandler
from model_store.catalog import get_spec
from model_store.factory import outputs_close
from tests.payloads import image_tensor_json, jpeg_bytes, reference_logits

SPEC = get_spec("resnet50", "eager")
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_runs_on_the_workers_device_and_a_bad_request_fails_alone(tmp_path, device):
    model_dir = model_dir_for(SPEC, tmp_path / "model")
    ctx = load_context(SPEC, model_dir, ServingOptions(batch_size=4), gpu=0 if device == "cuda" else None)
    handler = PlainModelHandler()
    handler.initialize(ctx)
    assert handler.device.device.type == device
    assert next(handler.model.parameters()).device.type == device
    good = [{"body": jpeg_bytes(seed=1)}, {"body": image_tensor_json(SPEC, seed=2)}, {"body": jpeg_bytes(seed=3)}]
    answers = call_batch(handler, ctx, [good[0], {"body": b"{not json"}, *good[1:]])
    assert [status for status, _ in answers] == [200, 400, 200, 200]
    assert "malformed JSON" in json.loads(answers[1][1])["message"]
    tol = 1e-4 if device == "cpu" else 1e-2  # cuDNN/TF32 kernels differ from the CPU reference
    ok = [body for status, body in answers if status == 200]
    for body, row in zip(ok, reference_logits(SPEC, good), strict=True):
        assert outputs_close(torch.tensor(body["logits"]), row, tol)
    assert handler.metrics.snapshot()["batches"] == {3: 1}


def test_cuda_graphs_are_for_the_plain_handler_only_and_ignored_on_a_cpu(tmp_path):
    with pytest.raises(ValueError, match="cuda_graphs applies to the plain handler"):
        ServingOptions(handler="ebird", cuda_graphs=True)
    ctx = load_context(SPEC, model_dir_for(SPEC, tmp_path / "model"), ServingOptions(batch_size=2, cuda_graphs=True))
    assert ctx.model_yaml_config["handler"]["cuda_graphs"] is True
    handler = PlainModelHandler()
    handler.initialize(ctx)
    assert isinstance(handler.model, torch.nn.Module)  # no graphs without CUDA: the model as loaded
    ctx.model_yaml_config["handler"]["cuda_graphs"] = "yes"
    with pytest.raises(RuntimeError, match="cuda_graphs must be true or false"):
        PlainModelHandler().initialize(ctx)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_decode_threads_batched_decodes_a_batchs_jpegs_in_one_call_and_refuses_a_bad_one_alone(tmp_path, device):
    """The plain handler with ``decode_threads: batched``: the JPEGs of one frontend batch go to one decoder
    call (nvJPEG on CUDA), a truncated one is halved out of it and refused, JSON goes to the codec."""
    from handlers.runtime.batched_decode import JpegBatchDecode

    model_dir = model_dir_for(SPEC, tmp_path / "model")
    options = ServingOptions(batch_size=8, decode_threads="batched")
    ctx = load_context(SPEC, model_dir, options, gpu=0 if device == "cuda" else None)
    handler = PlainModelHandler()
    handler.initialize(ctx)
    assert isinstance(handler.jpeg_batches, JpegBatchDecode)
    jpegs = [jpeg_bytes(seed=i) for i in range(5)]
    batch = [{"body": raw} for raw in jpegs[:3]] + [{"body": jpegs[3][:3000]}, {"body": image_tensor_json(SPEC, 9)}]
    batch.append({"body": jpegs[4]})
    answers = call_batch(handler, ctx, batch)
    assert [status for status, _ in answers] == [200, 200, 200, 415, 200, 200], answers
    assert max(handler.jpeg_batches.batch_sizes) > 1, handler.jpeg_batches.batch_sizes
    good = jpegs[:3] + [jpegs[4]]
    images = [item.tensors[0] for item in JpegBatchDecode(handler.codec, handler.device.device)(good)]
    with torch.inference_mode():
        expected = handler.model(torch.stack(images)).cpu()
    for (_, body), row in zip([answers[i] for i in (0, 1, 2, 5)], expected, strict=True):
        assert outputs_close(torch.tensor(body["logits"]), row, 1e-2 if device == "cuda" else 1e-4)
    (_, body), (row,) = answers[4], reference_logits(SPEC, [batch[4]])
    assert outputs_close(torch.tensor(body["logits"]), row, 1e-2 if device == "cuda" else 1e-4)


def test_the_plain_handler_takes_decode_threads_only_as_batched():
    with pytest.raises(ValueError, match="only as 'batched'"):
        ServingOptions(decode_threads=2)
    assert ServingOptions(decode_threads="batched").decode_threads == "batched"

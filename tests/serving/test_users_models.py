"""A model that is not in the catalog, saved by its user, served by every handler here that can run it.

The model is defined in this file (a small convolutional net, seeded), saved
as a ``torch.export`` program and as a TorchScript file, archived with
``packrat archive --serialized-file`` and served through the session's real
TorchServe; each handler's answers must equal the model's own output for the
same input.  A model a handler cannot run is refused before any archive is
written, in one line naming why.
"""

from __future__ import annotations

import json
import re

import pytest
import requests
import torch
from torch import nn

from archiver.cli import main as archive_main
from archiver.options import ServingOptions
from archiver.serialized import build_serialized_archive
from model_store.catalog import SERIALIZED
from model_store.samples import image_tensor_json
from model_store.user_models import describe

IMAGE = "image:3x32x32"


class TinyNet(nn.Module):
    """Not a catalog model: conv → batch norm → ReLU → pooling → linear, with a branch the cut must keep."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.side = nn.Conv2d(3, 8, 1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x))) + self.side(x)
        return self.head(y.mean(dim=(2, 3)))


def tiny_net() -> nn.Module:
    torch.manual_seed(7)
    net = TinyNet().eval()
    with torch.no_grad():  # running statistics that are not the identity, as a trained net's
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    return net


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, object]:
    """The net as its user would save it: a torch.export program with a dynamic batch, and TorchScript."""
    folder = tmp_path_factory.mktemp("users_model")
    net = tiny_net()
    example = (torch.randn(2, 3, 32, 32),)
    program = torch.export.export(net, example, dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    torch.export.save(program, folder / "tinynet.pt2")
    static = torch.export.export(net, (torch.randn(1, 3, 32, 32),))
    torch.export.save(static, folder / "static.pt2")
    torch.jit.save(torch.jit.trace(net, example), folder / "tinynet.pt")
    return {"net": net, "export": folder / "tinynet.pt2", "static": folder / "static.pt2",
            "script": folder / "tinynet.pt"}  # fmt: skip


HANDLERS = [
    ("plain", []),
    ("nimble", ["--handler-config", json.dumps({"buckets": [1, 2, 4]})]),
    ("dvabatch", ["--handler-config", json.dumps({"segments": 2, "max_batch": 4, "max_inflight": 8})]),
    ("ebird", ["--handler-config", json.dumps({"worker_batches": [1, 2], "max_inflight": 8, "pool_slots": 8})]),
]


@pytest.mark.torchserve
@pytest.mark.parametrize("handler, settings", HANDLERS, ids=[h for h, _ in HANDLERS])
def test_each_handler_serves_a_users_exported_model_with_the_models_answers(
    saved, torchserve, model_store_dir, handler, settings, capsys
):
    args = ["--serialized-file", str(saved["export"]), "--name", "tinynet", "--input", IMAGE,
            "--handler", handler, *settings, "--out", str(model_store_dir), "--force"]  # fmt: skip
    assert archive_main(args) == 0
    path = capsys.readouterr().out.strip().splitlines()[-1]
    name = path.rsplit("/", 1)[-1].removesuffix(".mar")
    torchserve.management().register(f"{name}.mar", model_name=name)
    try:
        spec = describe(saved["export"], "tinynet", IMAGE)
        url = f"{torchserve.inference_url}/predictions/{name}"
        for seed in range(3):
            payload = image_tensor_json(spec, seed=seed)
            answer = requests.post(url, json=payload, timeout=60)
            assert answer.status_code == 200, answer.text
            with torch.no_grad():
                expected = saved["net"](torch.tensor(payload["data"]).unsqueeze(0))[0]
            assert torch.allclose(torch.tensor(answer.json()["logits"]), expected, atol=1e-4)
        bad = requests.post(url, json={"data": [[1.0, 2.0]]}, timeout=60)
        assert bad.status_code == 400 and "shape" in bad.json()["message"]
    finally:
        torchserve.management().unregister(name)


def test_a_torchscript_file_serves_plainly_but_cannot_be_cut(saved, tmp_path):
    spec = describe(saved["script"], "tinynet", IMAGE)
    assert spec.family == SERIALIZED and spec.arch == "torchscript"
    assert build_serialized_archive(saved["script"], spec, tmp_path).name == "tinynet.mar"
    for handler in ("dvabatch", "nimble"):
        with pytest.raises(ValueError, match="TorchScript file cannot be cut.*torch.export.save"):
            build_serialized_archive(saved["script"], spec, tmp_path, ServingOptions(handler=handler))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tinynet.mar"]


@pytest.mark.parametrize(
    "which, input_text, handler, message",
    [
        ("static", IMAGE, "plain", "does not run on images of shape 3x32x32 at batch 1 and 3.*dynamic batch"),
        ("export", "image:3x64", "plain", "image input needs a shape C x H x W"),
        ("export", "video:3x64", "plain", "input must be image:CxHxW"),
        ("export", "tokens:16", "plain", r"needs a vocabulary size \(--vocab-size"),
        ("export", IMAGE, "orca", "the orca handler serves GPT-2"),
        ("export", IMAGE, "reef", "serves a group of models"),
    ],
)
def test_a_model_a_handler_cannot_run_is_refused_in_one_line(saved, tmp_path, capsys, which, input_text, handler,
                                                             message):  # fmt: skip
    args = ["--serialized-file", str(saved[which]), "--name", "tinynet", "--input", input_text,
            "--handler", handler, "--out", str(tmp_path)]  # fmt: skip
    assert archive_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert re.search(message, err), err
    assert not list(tmp_path.iterdir())


def test_a_file_that_is_no_saved_model_is_refused_by_name(tmp_path, capsys):
    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"not a model")
    assert archive_main(["--serialized-file", str(junk), "--name", "x", "--input", IMAGE, "--out", str(tmp_path)]) == 2
    assert "neither a TorchScript file" in capsys.readouterr().err


class TinyTextNet(nn.Module):
    """Token ids and their mask in, two logits out: a masked mean of embeddings through a linear head."""

    def __init__(self, vocab: int = 100) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(ids) * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return self.head(pooled)


@pytest.mark.torchserve
@pytest.mark.parametrize("handler", ["plain", "dvabatch"])
def test_a_users_token_model_is_served_with_its_own_answers_and_its_vocabulary_enforced(
    torchserve, model_store_dir, tmp_path, handler, capsys
):
    torch.manual_seed(3)
    net = TinyTextNet().eval()
    ids, mask = torch.randint(0, 100, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(net, (ids, mask), dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, tmp_path / "text.pt2")
    extra = ["--handler-config", json.dumps({"segments": 2, "max_batch": 4})] if handler == "dvabatch" else []
    args = ["--serialized-file", str(tmp_path / "text.pt2"), "--name", "tinytext", "--input", "tokens:12",
            "--vocab-size", "100", "--handler", handler, *extra, "--out", str(model_store_dir), "--force"]  # fmt: skip
    assert archive_main(args) == 0, capsys.readouterr().err
    name = capsys.readouterr().out.strip().splitlines()[-1].rsplit("/", 1)[-1].removesuffix(".mar")
    torchserve.management().register(f"{name}.mar", model_name=name)
    try:
        url = f"{torchserve.inference_url}/predictions/{name}"
        for row in ([5, 17, 42], list(range(12)), [99]):
            answer = requests.post(url, json={"input_ids": row}, timeout=60)
            assert answer.status_code == 200, answer.text
            padded = torch.zeros(1, 12, dtype=torch.long)
            padded[0, : len(row)] = torch.tensor(row)
            row_mask = (torch.arange(12) < len(row)).long().unsqueeze(0)
            with torch.no_grad():
                expected = net(padded, row_mask)[0]
            assert torch.allclose(torch.tensor(answer.json()["logits"]), expected, atol=1e-5)
        outside = requests.post(url, json={"input_ids": [3, 100]}, timeout=60)
        assert outside.status_code == 400 and "outside the vocabulary [0, 100)" in outside.json()["message"]
    finally:
        torchserve.management().unregister(name)

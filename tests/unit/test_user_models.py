"""Describing and loading a user's own model: GPT-2-family checkpoints and the entry points' descriptions."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from handlers.entry_points import HandlerEntry, ModelRefused, completed_section
from handlers.registry import handler_kind
from model_store.user_models import (
    GPT2_CHECKPOINT,
    describe_checkpoint,
    gpt2_checkpoint_config,
    load_checkpoint,
)

SMALL = {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 40, "vocab_size": 97}


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, transformers.GPT2LMHeadModel]:
    torch.manual_seed(5)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SMALL)).eval()
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt", model


def test_a_save_pretrained_checkpoint_loads_with_the_models_own_logits(checkpoint):
    folder, model = checkpoint
    spec = describe_checkpoint(folder / "config.json", "mine")
    assert (spec.family, spec.arch, spec.seq_len, spec.vocab_size) == ("gpt2", GPT2_CHECKPOINT, 40, 97)
    loaded = load_checkpoint(folder / "model.safetensors")
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        got = loaded(ids, torch.ones_like(ids))
        assert torch.equal(got, model(input_ids=ids).logits[:, -1])
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.transformer.wte.weight.data_ptr()  # tied


def test_a_base_models_weights_without_prefix_load_too(checkpoint, tmp_path):
    folder, model = checkpoint
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    torch.save(model.transformer.state_dict(), bare / "weights.bin")  # a GPT2Model's keys: h.0..., wte...
    loaded = load_checkpoint(bare / "weights.bin")
    assert torch.equal(loaded.model.transformer.wte.weight, model.transformer.wte.weight)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "t5"}, r"Llama-family checkpoint is needed \(gpt2, llama, qwen2\); .* model_type 't5'"),
        ({"activation_function": "relu"}, "sets activation_function='relu'; GPT-2 as served here needs 'gelu_new'"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ],
)
def test_a_checkpoint_orca_would_answer_wrongly_is_refused_by_the_setting(checkpoint, change, message):
    folder, _ = checkpoint
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        gpt2_checkpoint_config(folder / "config.json")


def test_weights_of_another_size_or_an_untied_head_left_out_are_refused(checkpoint, tmp_path):
    folder, model = checkpoint
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    with pytest.raises(ValueError, match="does not fit config.json"):
        load_checkpoint(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match=r"1 weights missing \(e.g. \['lm_head.weight'\]\)"):
        load_checkpoint(folder / "model.safetensors")
    with pytest.raises(ValueError, match="no config.json beside the weights"):
        gpt2_checkpoint_config(tmp_path / "config.json")


def test_the_entry_point_fills_in_the_spec_from_the_users_description(tmp_path):
    program = torch.export.export(torch.nn.Linear(4, 2), (torch.randn(2, 4),))
    torch.export.save(program, tmp_path / "m.pt2")
    section = completed_section(handler_kind("plain"), {"input": "image:3x8x8"}, "m", tmp_path, "m.pt2")
    assert section["spec"]["family"] == "serialized" and section["spec"]["image_shape"] == [3, 8, 8]
    members = [{"name": "a", "file": "m.pt2", "input": "image:3x8x8"}]
    group = completed_section(handler_kind("reef"), {"members": members}, "g", tmp_path, None)
    assert group["members"][0]["artefact"] == "m.pt2" and group["members"][0]["spec"]["name"] == "a"
    with pytest.raises(ModelRefused, match="missing.pt2 is not in the archive; pass it with --extra-files"):
        completed_section(handler_kind("reef"), {"members": [{"name": "b", "file": "missing.pt2"}]}, "g", tmp_path,
                          None)  # fmt: skip
    with pytest.raises(ModelRefused, match="list handler.members"):
        completed_section(handler_kind("reef"), {}, "g", tmp_path, None)
    with pytest.raises(ModelRefused, match="no model file; pass it with --serialized-file"):
        completed_section(handler_kind("plain"), {"input": "image:3x8x8"}, "m", tmp_path, None)


def test_an_async_handler_without_async_communication_is_refused_before_it_loads_anything(tmp_path):
    context = SimpleNamespace(model_yaml_config={"handler": {"input": "image:3x8x8"}}, manifest={"model": {}},
                              system_properties={"model_dir": str(tmp_path)})  # fmt: skip
    entry = HandlerEntry("dvabatch")
    with pytest.raises(ModelRefused, match="set asyncCommunication: true in model-config.yaml"):
        entry(None, context)
    assert entry.handler is None and not entry.initialized

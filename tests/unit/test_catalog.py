import re
from pathlib import Path

import pytest

from archiver.options import ServingOptions
from model_store.catalog import EXECUTION_MODES, CatalogError, ModelSpec, get_spec, load_catalog

REQUIRED = {
    "resnet50",
    "inception_v3",
    "vgg19",
    "densenet201",
    "efficientnet_b0",
    "resnet152",
    "unet",
    "bert-base",
    "distilbert",
    "gpt2",
}


def test_catalog_has_the_required_models_with_input_specs():
    catalog = load_catalog()
    assert set(catalog) >= REQUIRED
    assert catalog["inception_v3"].image_shape == (3, 299, 299)
    assert catalog["resnet50"].image_shape == (3, 224, 224)
    assert catalog["bert-base"].seq_len and catalog["gpt2"].seq_len
    assert {n for n, s in catalog.items() if s.ci} == {"resnet50", "bert-mini"}
    for name, spec in catalog.items():  # llama-tiny is Orca's (its engine runs the eager model's modules)
        assert set(spec.modes) == ({"eager"} if name == "llama-tiny" else set(EXECUTION_MODES)), name


def test_spec_round_trips_through_plain_data():
    spec = get_spec("bert-base", "script")
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_unknown_model_and_mode_are_refused():
    with pytest.raises(CatalogError, match="unknown model 'nope'"):
        get_spec("nope")
    with pytest.raises(CatalogError, match="cannot be built in mode 'onnx'"):
        get_spec("resnet50", "onnx")


@pytest.mark.parametrize(
    "body, message",
    [
        ("models: [1, 2]", "expected a mapping"),
        ("models: {m: {family: torchvision, arch: resnet18}}", "missing input.kind"),
        ("models: {m: {family: jax, arch: x, input: {kind: image, shape: [3, 8, 8]}}}", "family must be one of"),
        (
            "models: {m: {family: torchvision, arch: x, input: {kind: image, shape: [1, 8, 8]}}}",
            r"needs shape \[3, H, W\]",
        ),
        ("models: {m: {family: bert, arch: x, input: {kind: tokens}}}", "positive seq_len"),
        ("models: {m: {family: unet, arch: unet, input: {kind: tokens, seq_len: 4}}}", "unet models take image input"),
        (
            "models: {m: {family: gpt2, arch: x, input: {kind: image, shape: [3, 8, 8]}}}",
            "only for torchvision and unet",
        ),
        ("models: {m: {arch: x, input: {kind: tokens, seq_len: 4}}}", "missing key 'family'"),
        ("models: {m: [", "not valid YAML"),
    ],
)
def test_malformed_catalogs_fail_with_a_reason(tmp_path: Path, body: str, message: str):
    path = tmp_path / "catalog.yaml"
    path.write_text(body)
    with pytest.raises(CatalogError, match=message):
        load_catalog(path)


def test_spec_from_archive_rejects_unknown_keys():
    data = get_spec("resnet50").to_dict() | {"bogus": 1}
    with pytest.raises(CatalogError, match="unknown model spec keys"):
        ModelSpec.from_dict(data)


def test_archive_names_map_back_to_catalog_names():
    from archiver.names import archive_name, catalog_name
    from handlers.registry import HANDLERS

    for name in ("resnet50", "bert-base", "inception_v3"):
        for mode in EXECUTION_MODES:
            for handler in HANDLERS:
                assert catalog_name(f"/store/{archive_name(name, mode, handler)}.mar") == name
    assert archive_name("bert-base", "eager", "ebird") == "bert-base_eager-ebird"
    assert catalog_name("custom.mar") == "custom"


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(handler="triton"), "unknown handler 'triton'"),
        (dict(handler="packrat", handler_settings=(("segments", 2),)), "plain handler takes no handler settings"),
        (dict(handler="ebird", handler_settings=(("worker_batches", []),)), "worker_batches"),
        (dict(handler="dvabatch", handler_settings=(("segments", 0),)), "segments"),
        (dict(handler="packrat", decode_threads=2), "decode_threads applies to async handlers"),
    ],
)
def test_bad_serving_options_are_refused_before_anything_is_built(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServingOptions(**options)


def test_bert_sizes_are_built_as_named_and_an_unknown_size_is_refused():
    import dataclasses

    from model_store.factory import build_model

    mini = build_model(get_spec("bert-mini")).model.config
    assert (mini.num_hidden_layers, mini.hidden_size, mini.num_attention_heads) == (4, 256, 4)
    assert mini.vocab_size == 30522  # the base model's vocabulary: the same token ids are valid for both
    with pytest.raises(ValueError, match="unknown BERT size 'bert-huge'; known: bert-base, bert-mini"):
        build_model(dataclasses.replace(get_spec("bert-mini"), arch="bert-huge"))


def test_the_host_bound_models_are_one_layer_deep_and_answer_in_their_shapes():
    import dataclasses

    import torch

    from model_store.factory import build_model, example_inputs

    for name, logits in (("bert-tiny1", 2), ("gpt2-tiny1", 50257)):
        spec = get_spec(name)
        model = build_model(spec)
        config = model.model.config
        assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (1, 32, 2), name
        with torch.no_grad():
            assert tuple(model(*example_inputs(spec, 3)).shape) == (3, logits)
    with pytest.raises(ValueError, match="unknown GPT-2 size 'gpt2-xl'"):
        build_model(dataclasses.replace(get_spec("gpt2"), arch="gpt2-xl"))

"""A user's own model, described as the catalog describes its models: a ``ModelSpec`` read from the files.

Two kinds of file are taken, as their users save them:

- a ``torch.jit.save`` or ``torch.export.save`` file (family ``serialized``,
  ``arch`` the format, read from the file's zip records), with the input it
  takes written as ``image:CxHxW`` or ``tokens:LENGTH`` plus a vocabulary;
- a GPT-2-family checkpoint as Hugging Face ``save_pretrained`` writes it
  (``config.json`` beside a weights file; family ``gpt2``, ``arch``
  ``checkpoint``), the shape Orca's engine runs.

Both the archiver (``packrat archive``) and the handlers' entry points (an
archive the user built with ``torch-model-archiver``) describe a model here,
so a model reaches every handler with the same description whichever way it
was packaged.  Anything that cannot be described is refused in one line.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import torch

from model_store.catalog import SERIALIZED, CatalogError, ModelSpec, validate_spec

# ``arch`` of a GPT-2-family model loaded from its user's checkpoint (config.json + weights).
GPT2_CHECKPOINT = "checkpoint"
CHECKPOINT_CONFIG = "config.json"
# What Orca's selective-batching GPT-2 (handlers/orca/gpt2.py) computes; a checkpoint asking for anything
# else would be answered wrongly, so it is refused by the setting's name.
GPT2_FEATURES = {
    "activation_function": "gelu_new",
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
}


def serialized_format(path: Path) -> str:
    """``export`` or ``torchscript``, read from the file's zip records (neither loads the model)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        names = []
    if any(n.endswith("/archive_format") for n in names):
        return "export"
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        return "torchscript"
    raise ValueError(
        f"{path} is neither a TorchScript file (torch.jit.save) nor a torch.export program (torch.export.save)"
    )


def parse_input(text: str, vocab_size: int | None = None) -> dict[str, Any]:
    """``image:3x224x224`` or ``tokens:128`` (with ``vocab_size``) into the spec's input fields."""
    kind, _, shape = str(text).partition(":")
    if kind == "tokens" and vocab_size is None:
        raise ValueError(
            "token input needs a vocabulary size (--vocab-size, or vocab_size in model-config.yaml); "
            "ids at or above it are refused with a 400"
        )
    try:
        if kind == "image":
            return {"input_kind": "image", "image_shape": tuple(int(d) for d in shape.lower().split("x"))}
        if kind == "tokens":
            return {"input_kind": "tokens", "seq_len": int(shape), "vocab_size": int(vocab_size)}
    except ValueError:
        pass  # a malformed shape: the same one-line usage as an unknown kind
    raise ValueError(f"input must be image:CxHxW (e.g. image:3x224x224) or tokens:LENGTH, got {text!r}")


def describe(path: Path, name: str, input_text: str, vocab_size: int | None = None) -> ModelSpec:
    """A saved model's description, checked as a catalog entry is (a bad one is refused in one line)."""
    spec = ModelSpec(
        name=name, family=SERIALIZED, arch=serialized_format(Path(path)), modes=("eager",),
        **parse_input(input_text, vocab_size),
    )  # fmt: skip
    return _validated(spec)


def describe_input(spec: ModelSpec) -> str:
    """The input a model takes, in words (for refusals)."""
    if spec.input_kind == "image":
        return "images of shape " + "x".join(str(d) for d in spec.image_shape)
    return f"token ids (input_ids, attention_mask) of length {spec.seq_len}"


def gpt2_checkpoint_config(config_path: Path) -> dict[str, Any]:
    """A checkpoint's ``config.json``, refused in one line unless it describes a GPT-2 Orca can run."""
    try:
        config = json.loads(Path(config_path).read_text())
    except FileNotFoundError:
        raise ValueError(f"no {CHECKPOINT_CONFIG} beside the weights: a checkpoint needs the config "
                         "save_pretrained writes (pass it with --extra-files)") from None  # fmt: skip
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path} is not a readable JSON config: {exc}") from None
    model_type = config.get("model_type")
    if model_type != "gpt2":
        raise ValueError(f"a GPT-2-family checkpoint is needed; {config_path} is model_type {model_type!r}")
    for key, wanted in GPT2_FEATURES.items():
        if key in config and config[key] != wanted:
            raise ValueError(f"the checkpoint sets {key}={config[key]!r}; GPT-2 as served here needs {wanted!r}")
    return config


def describe_gpt2_checkpoint(config_path: Path, name: str) -> ModelSpec:
    """A GPT-2-family checkpoint's description: tokens up to its context length, its own vocabulary."""
    config = gpt2_checkpoint_config(config_path)
    spec = ModelSpec(
        name=name, family="gpt2", arch=GPT2_CHECKPOINT, input_kind="tokens", modes=("eager",),
        seq_len=int(config.get("n_positions", 1024)), vocab_size=int(config.get("vocab_size", 50257)),
    )  # fmt: skip
    return _validated(spec)


def _validated(spec: ModelSpec) -> ModelSpec:
    try:
        validate_spec(spec)
    except CatalogError as exc:
        raise ValueError(str(exc)) from None
    return spec


def load_gpt2_checkpoint(weights: Path, config_path: Path | None = None) -> torch.nn.Module:
    """A GPT-2-family checkpoint as the catalog's GPT-2 is served: ``NextTokenLogits(GPT2LMHeadModel)``, eval.

    ``weights`` is a ``.safetensors`` or ``torch.save`` file of the model's
    state dict, with or without the ``transformer.`` prefix (a ``GPT2Model``'s
    or a ``GPT2LMHeadModel``'s); ``config_path`` defaults to the
    ``config.json`` beside it.  The language-model head is tied to the token
    embedding when the checkpoint leaves it out, as ``save_pretrained`` does.
    A weights file that does not fit the config is refused in one line.
    """
    import transformers

    from model_store.factory import NextTokenLogits

    weights = Path(weights)
    config = gpt2_checkpoint_config(config_path or weights.with_name(CHECKPOINT_CONFIG))
    config = transformers.GPT2Config.from_dict({**config, "use_cache": False})
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(weights))
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    if not any(key.startswith("transformer.") for key in state):
        state = {f"transformer.{key}": value for key, value in state.items()}
    model = transformers.GPT2LMHeadModel(config)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a tensor of the wrong shape: the weights are another size of model
        first = str(exc).strip().splitlines()[1:2] or [type(exc).__name__]
        raise ValueError(f"{weights.name} does not fit {CHECKPOINT_CONFIG}: {first[0].strip()}") from None
    if config.tie_word_embeddings:  # the head is the embedding: save_pretrained leaves it out
        missing = [k for k in missing if k != "lm_head.weight"]
    unexpected = [k for k in unexpected if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise ValueError(
            f"{weights.name} does not fit {CHECKPOINT_CONFIG}: "
            f"{len(missing)} weights missing (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})"
        )
    model.tie_weights()
    return NextTokenLogits(model).eval()

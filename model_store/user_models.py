"""A user's own model, described as the catalog describes its models: a ``ModelSpec`` read from the files.

Two kinds of file are taken, as their users save them:

- a ``torch.jit.save`` or ``torch.export.save`` file (family ``serialized``,
  ``arch`` the format, read from the file's zip records), with the input it
  takes written as ``image:CxHxW`` or ``tokens:LENGTH`` plus a vocabulary;
- a GPT-2- or Llama-family checkpoint as Hugging Face ``save_pretrained``
  writes it (``config.json`` beside a weights file; family ``gpt2`` or
  ``llama``, ``arch`` ``checkpoint``), the shapes Orca's engine runs.

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
# Checkpoints of the Llama family's shape (RoPE, RMSNorm, grouped-query attention, SwiGLU) that Orca's
# ``handlers/orca/llama.py`` runs; ``check_llama_config`` refuses the settings it does not compute.
LLAMA_TYPES = ("llama", "qwen2")
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


def _read_checkpoint_config(config_path: Path) -> dict[str, Any]:
    """A checkpoint's ``config.json``, or a one-line refusal saying why it cannot be read."""
    try:
        return json.loads(Path(config_path).read_text())
    except FileNotFoundError:
        raise ValueError(f"no {CHECKPOINT_CONFIG} beside the weights: a checkpoint needs the config "
                         "save_pretrained writes (pass it with --extra-files)") from None  # fmt: skip
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path} is not a readable JSON config: {exc}") from None


def _check_gpt2_config(config: dict[str, Any], config_path: Path) -> None:
    model_type = config.get("model_type")
    if model_type != "gpt2":
        raise ValueError(f"a GPT-2- or Llama-family checkpoint is needed ({', '.join(('gpt2', *LLAMA_TYPES))}); "
                         f"{config_path} is model_type {model_type!r}")  # fmt: skip
    for key, wanted in GPT2_FEATURES.items():
        if key in config and config[key] != wanted:
            raise ValueError(f"the checkpoint sets {key}={config[key]!r}; GPT-2 as served here needs {wanted!r}")


def gpt2_checkpoint_config(config_path: Path) -> dict[str, Any]:
    """A checkpoint's ``config.json``, refused in one line unless it describes a GPT-2 Orca can run."""
    config = _read_checkpoint_config(config_path)
    _check_gpt2_config(config, config_path)
    return config


def check_llama_config(config: Any) -> None:
    """Refuse, naming it, a Llama-family setting Orca's ``SelectiveLlama`` does not compute.

    ``config``: a ``config.json`` as a dict, or a transformers config.
    """
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    if get("use_sliding_window", False) and get("sliding_window"):
        raise UnsupportedCheckpoint(f"use_sliding_window (window {get('sliding_window')}) is not supported")
    if get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpoint(f"hidden_act {get('hidden_act')!r} is not supported (the Llama MLP is SiLU)")
    if get("pretraining_tp", 1) not in (None, 1):
        raise UnsupportedCheckpoint(f"pretraining_tp {get('pretraining_tp')} is not supported")


class UnsupportedCheckpoint(ValueError):
    """A checkpoint setting the served model does not compute."""


def checkpoint_family(config_path: Path) -> tuple[str, dict[str, Any]]:
    """A checkpoint's family (``gpt2`` or ``llama``) and ``config.json``, refused in one line unless Orca runs it."""
    config = _read_checkpoint_config(config_path)
    if config.get("model_type") in LLAMA_TYPES:
        check_llama_config(config)
        return "llama", config
    _check_gpt2_config(config, config_path)
    return "gpt2", config


def describe_checkpoint(config_path: Path, name: str) -> ModelSpec:
    """A GPT-2- or Llama-family checkpoint's description: tokens up to its context length, its own vocabulary."""
    family, config = checkpoint_family(config_path)
    if family == "gpt2":
        seq_len, vocab = config.get("n_positions", 1024), config.get("vocab_size", 50257)
    else:
        seq_len, vocab = config.get("max_position_embeddings", 2048), config["vocab_size"]
    spec = ModelSpec(
        name=name, family=family, arch=GPT2_CHECKPOINT, input_kind="tokens", modes=("eager",),
        seq_len=int(seq_len), vocab_size=int(vocab),
    )  # fmt: skip
    return _validated(spec)


def load_checkpoint(weights: Path, config_path: Path | None = None) -> torch.nn.Module:
    """A user's checkpoint as the catalog's causal LMs are served: ``NextTokenLogits(...ForCausalLM)``, eval.

    ``weights`` is a ``.safetensors`` or ``torch.save`` file of the model's
    state dict; ``config_path`` defaults to the ``config.json`` beside it.
    A GPT-2 state dict may leave out the ``transformer.`` prefix (a
    ``GPT2Model``'s).  The language-model head is tied to the token embedding
    when the checkpoint leaves it out, as ``save_pretrained`` does.  A
    weights file that does not fit the config is refused in one line.
    """
    import transformers

    from model_store.factory import NextTokenLogits

    weights = Path(weights)
    family, config = checkpoint_family(config_path or weights.with_name(CHECKPOINT_CONFIG))
    state = _read_state(weights)
    if family == "gpt2":
        hf_config = transformers.GPT2Config.from_dict({**config, "use_cache": False})
        model = transformers.GPT2LMHeadModel(hf_config)
        if not any(key.startswith("transformer.") for key in state):
            state = {f"transformer.{key}": value for key, value in state.items()}
        buffers = (".attn.bias", ".attn.masked_bias")  # GPT-2's causal-mask buffers, in older checkpoints
    else:
        settings = {k: v for k, v in config.items() if k != "model_type"}
        hf_config = transformers.AutoConfig.for_model(config["model_type"], **settings)
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
        buffers = ("rotary_emb.inv_freq",)  # computed from the config, whether saved or not
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a tensor of the wrong shape: the weights are another size of model
        first = str(exc).strip().splitlines()[1:2] or [type(exc).__name__]
        raise ValueError(f"{weights.name} does not fit {CHECKPOINT_CONFIG}: {first[0].strip()}") from None
    if hf_config.tie_word_embeddings:  # the head is the embedding: save_pretrained leaves it out
        missing = [k for k in missing if k != "lm_head.weight"]
    missing = [k for k in missing if not k.endswith(buffers)]
    unexpected = [k for k in unexpected if not k.endswith(buffers)]
    if missing or unexpected:
        raise ValueError(
            f"{weights.name} does not fit {CHECKPOINT_CONFIG}: "
            f"{len(missing)} weights missing (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})"
        )
    model.tie_weights()
    return NextTokenLogits(model).eval()


def _read_state(weights: Path) -> dict[str, torch.Tensor]:
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(weights))
    return torch.load(weights, map_location="cpu", weights_only=True)


def _validated(spec: ModelSpec) -> ModelSpec:
    try:
        validate_spec(spec)
    except CatalogError as exc:
        raise ValueError(str(exc)) from None
    return spec

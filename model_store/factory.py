"""Build catalog models with seeded weights, and prepare them per execution mode.

Every model here has one calling convention, ``model(*inputs) -> Tensor[B, ...]``:
images take ``(pixels,)``, text models take ``(input_ids, attention_mask)``;
classifiers answer ``[B, C]`` logits, the segmentation model ``[B, C, H, W]``.
Hugging Face models are wrapped so that they return plain logits; that is what
makes ``torch.jit.trace`` and ``torch.compile`` treat every family alike, and
what lets the handler, the profiler and the tests share one code path.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from model_store.catalog import SERIALIZED, ModelSpec


class LogitsOnly(nn.Module):
    """Adapts a Hugging Face classifier to ``(ids, mask) -> logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class NextTokenLogits(nn.Module):
    """Adapts a causal LM to ``(ids, mask) -> logits of the next token``.

    Sequences are right-padded to a fixed length, so the next-token logits sit
    at each row's last real position, not at the last column.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        last = attention_mask.sum(dim=1) - 1
        rows = torch.arange(logits.shape[0], device=logits.device)
        return logits[rows, last]


# BERT sizes by the catalog's ``arch``: the base model, and a small one with the
# same vocabulary and sequence length at a tenth of the parameters, which the
# serving tests use on two cores.
BERT_SIZES: dict[str, dict[str, int]] = {
    "bert-base": {},  # BertConfig() defaults: 12 layers, hidden 768, 12 heads
    "bert-mini": {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024},
    # Host-bound on purpose: compute per batch in the tens of microseconds on a CPU, the regime a fast GPU
    # puts every model in, where a handler's per-request Python is what limits it.
    "bert-tiny1": {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64},
}
# GPT-2 sizes likewise: the small model, and a one-layer one for the host-bound regime.
GPT2_SIZES: dict[str, dict[str, int]] = {
    "gpt2-small": {},  # GPT2Config() defaults: 12 layers, hidden 768, 12 heads
    "gpt2-tiny1": {"n_layer": 1, "n_embd": 32, "n_head": 2},
}
# A small Llama-family model (random weights, like the others): the shape of Llama, Qwen2 and SmolLM checkpoints
# (RoPE, RMSNorm, SwiGLU, grouped-query attention: 4 query heads share 2 key/value heads), for Orca's demo and
# benchmarks.
LLAMA_SIZES: dict[str, dict[str, int]] = {
    "llama-tiny": {
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "vocab_size": 32000,
    },  # fmt: skip
}


def _build_architecture(spec: ModelSpec) -> nn.Module:
    if spec.family == "torchvision":
        import torchvision

        kwargs = {"weights": None}
        if spec.arch == "inception_v3":
            # The auxiliary head only matters for training; eval() returns
            # plain logits either way, but building it costs memory.
            kwargs["aux_logits"] = False
            kwargs["init_weights"] = True
        return torchvision.models.get_model(spec.arch, **kwargs)

    if spec.family == "unet":
        from model_store.unet import UNet

        return UNet(classes=spec.num_labels or 2)

    import transformers

    if spec.family == "bert":
        if spec.arch not in BERT_SIZES:
            raise ValueError(f"unknown BERT size {spec.arch!r}; known: {', '.join(BERT_SIZES)}")
        config = transformers.BertConfig(num_labels=spec.num_labels or 2, **BERT_SIZES[spec.arch])
        return LogitsOnly(transformers.BertForSequenceClassification(config))
    if spec.family == "distilbert":
        config = transformers.DistilBertConfig(num_labels=spec.num_labels or 2)
        return LogitsOnly(transformers.DistilBertForSequenceClassification(config))
    if spec.family == "gpt2":
        # No KV cache: a served request is one full forward pass, and a cache
        # object in the outputs would be recorded into traces as dead state.
        if spec.arch not in GPT2_SIZES:
            raise ValueError(f"unknown GPT-2 size {spec.arch!r}; known: {', '.join(GPT2_SIZES)}")
        config = transformers.GPT2Config(use_cache=False, **GPT2_SIZES[spec.arch])
        return NextTokenLogits(transformers.GPT2LMHeadModel(config))
    if spec.family == "llama":
        if spec.arch not in LLAMA_SIZES:
            raise ValueError(f"unknown Llama size {spec.arch!r}; known: {', '.join(LLAMA_SIZES)}")
        config = transformers.LlamaConfig(use_cache=False, tie_word_embeddings=False, **LLAMA_SIZES[spec.arch])
        return NextTokenLogits(transformers.LlamaForCausalLM(config))
    raise ValueError(f"unsupported family {spec.family!r}")


def build_model(spec: ModelSpec) -> nn.Module:
    """The architecture with weights drawn from ``spec.seed``, in eval mode.

    The same spec always yields bit-identical weights, which is how tests
    compare a served result with the model's direct output.
    """
    if spec.family == SERIALIZED:
        raise ValueError(f"{spec.name} is loaded from the file its user saved, not built from an architecture")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = _build_architecture(spec)
    return model.eval()


def vocab_size(spec: ModelSpec) -> int:
    """Token-id upper bound (exclusive) of a text model: its own, or its family's config's."""
    if spec.vocab_size is not None:
        return spec.vocab_size
    import transformers

    configs = {
        "bert": transformers.BertConfig,
        "distilbert": transformers.DistilBertConfig,
        "gpt2": transformers.GPT2Config,
    }
    if spec.family == "llama" and spec.arch in LLAMA_SIZES:
        return LLAMA_SIZES[spec.arch]["vocab_size"]
    if spec.family not in configs:
        raise ValueError(f"{spec.name} takes no tokens")
    return int(configs[spec.family]().vocab_size)


def example_inputs(spec: ModelSpec, batch: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random but reproducible model inputs of batch size ``batch``."""
    gen = torch.Generator().manual_seed(seed)
    if spec.input_kind == "image":
        return (torch.randn((batch, *spec.image_shape), generator=gen),)
    assert spec.seq_len is not None
    ids = torch.randint(0, vocab_size(spec), (batch, spec.seq_len), generator=gen)
    mask = torch.ones_like(ids)
    return ids, mask


def script_model(model: nn.Module, example: tuple[torch.Tensor, ...]) -> torch.jit.ScriptModule:
    """Trace and freeze: Packrat's "graph mode".

    Tracing records one batch size, but the recorded graphs of the catalog's
    models do not bake the batch dimension in (checked by the builder for every
    archive it writes), so one trace serves every batch size.
    """
    with torch.no_grad(), warnings.catch_warnings():
        # torch.jit is deprecated upstream and Hugging Face code trips the
        # tracer's generic warnings; the builder checks every trace against
        # eager mode on padded inputs instead of trusting or printing these.
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        traced = torch.jit.trace(model, example, strict=False, check_trace=False)
        frozen = torch.jit.freeze(traced.eval())
    return frozen


def compile_model(model: nn.Module) -> nn.Module:
    """``torch.compile`` with dynamic shapes, so batch size changes do not recompile."""
    return torch.compile(model, dynamic=True)


def outputs_close(got: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    """Equal up to ``tol`` relative to the output's scale.

    Untrained deep networks in eval mode have huge logits (random-init
    ResNet-152 reaches 1e8, because BatchNorm's running statistics do not
    normalise an untrained net), so an absolute tolerance would flag float
    reassociation noise that eager mode itself shows between batch sizes.
    """
    if got.shape != expected.shape:
        return False
    scale = max(1.0, float(expected.abs().max()))
    return float((got - expected).abs().max()) <= tol * scale

"""An archive's serialized model, loaded in the archive's execution mode; every handler that runs one model uses it."""

from __future__ import annotations

import warnings

import torch

from model_store.catalog import SERIALIZED, ModelSpec
from model_store.factory import build_model, compile_model
from model_store.user_models import GPT2_CHECKPOINT, load_checkpoint


def load_model(spec: ModelSpec, artefact: str, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Load an archive's artefact in the archive's execution mode, on ``device``."""
    if spec.family == SERIALIZED:  # a user's own file, run as it was saved
        if spec.arch == "export":
            # An exported program's module is already in inference form (and refuses .eval()).
            return torch.export.load(artefact).module().to(device)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            return torch.jit.load(artefact, map_location=device).eval()
    if spec.family in ("gpt2", "llama") and spec.arch == GPT2_CHECKPOINT:  # a user's checkpoint, config.json beside it
        return load_checkpoint(artefact).to(device)
    if spec.mode == "script":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)  # torch.jit's deprecation notice
            return torch.jit.load(artefact, map_location=device).eval()
    model = build_model(spec)
    model.load_state_dict(torch.load(artefact, map_location="cpu", weights_only=True))
    model = model.to(device)
    if spec.mode == "compile":
        # Compiled after the move: the graph is traced for the device it runs on.
        model = compile_model(model)
    return model

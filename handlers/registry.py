"""Every system's handler, in one place: what the archiver needs to know to build an archive for it.

A ``HandlerKind`` says which class TorchServe runs (the archiver writes a
one-class entry module that subclasses it), whether TorchServe must hand it
each request as it arrives (async), which settings class validates its
``handler.<name>`` section of model-config.yaml, whether one archive serves a
group of models, and which models it can serve: ``check_spec`` refuses a model
from its description alone, ``check_model`` refuses one whose built module the
worker could not run as it should (a cut that does not reproduce it, a graph
that does not trace).  Both take the model's description, so a model that is
not in the catalog passes the same checks as one that is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from handlers.dvabatch.handler import DvaBatchHandler
from handlers.dvabatch.policy import DvaBatchConfig
from handlers.ebird.config import EbirdConfig
from handlers.ebird.handler import EbirdHandler
from handlers.nimble.config import NimbleConfig
from handlers.nimble.handler import NimbleHandler
from handlers.nimble.program import freeze, reproduces
from handlers.orca.config import OrcaConfig
from handlers.orca.handler import OrcaHandler
from handlers.plain_handler import PlainModelHandler
from handlers.reef.config import ReefConfig
from handlers.reef.handler import ReefHandler
from handlers.runtime.segment_profile import slice_catalog_model
from model_store.catalog import SERIALIZED, ModelSpec
from model_store.factory import example_inputs

SpecCheck = Callable[[str, ModelSpec], None]
ModelCheck = Callable[[ModelSpec, torch.nn.Module, Any], None]


@dataclass(frozen=True)
class HandlerKind:
    """One system's handler as the archiver sees it."""

    name: str
    handler: type  # the class an archive's entry module subclasses
    # Async handlers schedule requests themselves: TorchServe must hand them
    # each request as it arrives (asyncCommunication, batch 1, no delay).
    asynchronous: bool = False
    # ``from_dict`` validates the handler's own section of model-config.yaml.
    settings: type | None = None
    # Serves several models from one archive instead of one archive per model.
    group: bool = False
    check_spec: SpecCheck | None = None
    check_model: ModelCheck | None = None
    # Serves a language model from its checkpoint (config.json + weights), not a saved module.
    checkpoint: bool = False

    def parse_settings(self, settings: Mapping[str, Any]) -> Any:
        """The handler's settings object (refused with a ``ValueError`` naming the bad key); None if it takes none."""
        if self.settings is None:
            if settings:
                raise ValueError(f"the {self.name} handler takes no handler settings")
            return None
        return self.settings.from_dict(dict(settings))

    @property
    def entry_file(self) -> str:
        """The entry module's file name inside an archive (also TorchServe's ``handler`` in its manifest)."""
        return f"{self.name}_handler.py"


def _graph_of(name: str, spec: ModelSpec) -> None:
    if spec.family == SERIALIZED and spec.arch != "export":
        raise ValueError(
            f"the {name} handler cuts the model's graph, and a TorchScript file cannot be cut: "
            "save the model with torch.export.save instead"
        )


def _eager_only(name: str, spec: ModelSpec) -> None:
    _graph_of(name, spec)
    if spec.mode != "eager":
        raise ValueError(f"the {name} handler slices the eager model; build {spec.name} in mode 'eager'")


def _traceable_image_model(name: str, spec: ModelSpec) -> None:
    _graph_of(name, spec)
    if spec.mode != "eager":
        raise ValueError(f"the {name} handler traces the eager model; build {spec.name} in mode 'eager'")
    if spec.input_kind != "image":
        raise ValueError(f"the {name} handler serves image models; {spec.name} takes {spec.input_kind}")


def _gpt2_eager(name: str, spec: ModelSpec) -> None:
    if spec.family not in ("gpt2", "llama") or spec.mode != "eager":
        raise ValueError(f"the {name} handler serves GPT-2 and Llama-family models in eager mode; "
                         f"{spec.name} is {spec.family}, {spec.mode!r}")  # fmt: skip


def _cut_reproduces(spec: ModelSpec, model: torch.nn.Module, settings: DvaBatchConfig | ReefConfig) -> None:
    """The worker runs the eager model cut into segments: refuse a model whose cut would not reproduce it."""
    slice_catalog_model(spec, model, settings.segments)


def _freezes(spec: ModelSpec, model: torch.nn.Module, settings: NimbleConfig) -> None:
    """Refuse a model the worker could not trace and freeze to the graph Nimble's programs run."""
    example = example_inputs(spec, batch=2, seed=1)
    with torch.inference_mode():
        frozen = freeze(model, example)
        if not reproduces(frozen(*example), model(*example)):
            raise RuntimeError(f"{spec.name}: the frozen fx graph disagrees with the eager model")


HANDLERS: dict[str, HandlerKind] = {
    kind.name: kind
    for kind in (
        # The plain handler: TorchServe's own batching, one model per worker, pinned by Packrat when planned.
        HandlerKind("plain", PlainModelHandler),
        HandlerKind("ebird", EbirdHandler, True, EbirdConfig),
        HandlerKind("dvabatch", DvaBatchHandler, True, DvaBatchConfig, check_spec=_eager_only,
                    check_model=_cut_reproduces),
        # One archive for a group of models served by one worker.
        HandlerKind("reef", ReefHandler, True, ReefConfig, group=True, check_spec=_eager_only,
                    check_model=_cut_reproduces),
        # Synchronous: TorchServe's own batching, Nimble's ahead-of-time programs per batch-size bucket.
        HandlerKind("nimble", NimbleHandler, False, NimbleConfig, check_spec=_traceable_image_model,
                    check_model=_freezes),
        # Async: every request joins the generation pool as it arrives; tokens streamed back.
        HandlerKind("orca", OrcaHandler, True, OrcaConfig, check_spec=_gpt2_eager, checkpoint=True),
    )
}  # fmt: skip
# The plain handler's name before it had one of its own; still accepted wherever a handler is named.
ALIASES = {"packrat": "plain"}


def handler_kind(name: str) -> HandlerKind:
    """The registered handler called ``name`` (or an alias of it); a ``ValueError`` listing the choices otherwise."""
    kind = HANDLERS.get(ALIASES.get(name, name))
    if kind is None:
        raise ValueError(f"unknown handler {name!r}; choose from {', '.join(HANDLERS)}")
    return kind

"""What an archive's model-config.yaml says: TorchServe's knobs and the handler's own section.

``ServingOptions`` is checked when it is made, against the handler registry
(``handlers/registry.py``), so a bad option is refused before any model is
built; ``model_config`` turns options and a model's description into the
model-config.yaml that travels inside the archive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from handlers.codecs import parse_token_lengths
from handlers.registry import ALIASES, HandlerKind, handler_kind
from handlers.runtime.async_handler import parse_encode_answers
from handlers.runtime.decode import parse_decode_threads
from handlers.runtime.metrics import parse_flush_interval
from handlers.runtime.worker_pump import parse_worker_pump
from model_store.catalog import ModelSpec


@dataclass(frozen=True)
class ServingOptions:
    """TorchServe knobs written into model-config.yaml (overridable at register time)."""

    batch_size: int = 1
    max_batch_delay_ms: int = 5
    response_timeout_s: int = 120
    max_payload_bytes: int = 8 * 1024 * 1024
    handler: str = "plain"  # a name in handlers.registry.HANDLERS ("packrat" is accepted for "plain")
    # The handler's own section of model-config.yaml (``handler.<name>``),
    # e.g. Ebird's worker batch sizes; validated at build time.
    handler_settings: tuple[tuple[str, Any], ...] = ()
    # Async handlers: where requests are decoded (``handlers/runtime/decode.py``):
    # N threads, 0 inline, "lane", "batched"; None leaves it to the runtime's default.
    # The plain handler takes "batched" alone: each batch's JPEGs in one decoder call.
    decode_threads: int | str | None = None
    # How often the handler hands its metrics to TorchServe, in seconds
    # (``handlers/runtime/metrics.py``; 0: at every event); None: the default.
    metrics_flush_interval_s: float | None = None
    # Async handlers, token models: the padded lengths requests are sorted
    # into (``handler.token_lengths``, DVABatch's input-diversity policy);
    # empty: every request padded to the sequence length.
    token_lengths: tuple[int, ...] = ()
    # Async handlers: which message pump runs TorchServe's async worker
    # (``handlers/runtime/worker_pump.py``): "lean" or "torchserve"; None: lean.
    worker_pump: str | None = None
    # Async handlers: where answers are encoded (``handlers/runtime/async_handler.py``):
    # "engine" (where each batch ends: the CPU lane) or "loop"; None: engine on CPU, loop on CUDA.
    encode_answers: str | None = None
    # The plain handler on CUDA: replay captured CUDA graphs, one per power-of-two
    # batch size up to ``batch_size`` (``handlers/plain_handler.py``).
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.handler in ALIASES:  # frozen: the alias is replaced by the name it stands for
            object.__setattr__(self, "handler", ALIASES[self.handler])
        self.kind.parse_settings(dict(self.handler_settings))
        if self.decode_threads is not None:
            if not self.kind.asynchronous and not (self.handler == "plain" and self.decode_threads == "batched"):
                raise ValueError(
                    f"{self.handler!r} decodes in its batch: decode_threads applies to async handlers, "
                    "and to the plain handler only as 'batched' (its batch's JPEGs in one decoder call)"
                )
            parse_decode_threads(self.decode_threads)
        if self.token_lengths and not self.kind.asynchronous:
            raise ValueError(f"token_lengths applies to async handlers; {self.handler!r} pads a batch to one length")
        if self.token_lengths and self.kind.group:
            raise ValueError(
                f"token_lengths applies to one-model archives; {self.handler!r} pads to each model's length"
            )
        if self.handler == "orca" and (self.decode_threads is not None or self.token_lengths):
            raise ValueError("the orca handler parses requests on its event loop and does not pad: "
                             "decode_threads and token_lengths do not apply")  # fmt: skip
        if self.decode_threads == "lane" and self.kind.group:
            raise ValueError(f"the {self.handler} handler has no CPU lanes to decode on; give decode_threads a count")
        if self.worker_pump is not None:
            if not self.kind.asynchronous or self.handler == "orca":
                raise ValueError(f"worker_pump applies to the scheduling async handlers; {self.handler!r} has none")
            parse_worker_pump(self.worker_pump)
        if self.encode_answers is not None:
            if not self.kind.asynchronous or self.handler == "orca":
                raise ValueError(f"encode_answers applies to the scheduling async handlers; {self.handler!r} has none")
            parse_encode_answers(self.encode_answers)
        if self.cuda_graphs and self.handler != "plain":
            raise ValueError(f"cuda_graphs applies to the plain handler; {self.handler!r} has its own settings")
        if self.metrics_flush_interval_s is not None:
            parse_flush_interval(self.metrics_flush_interval_s)

    @property
    def kind(self) -> HandlerKind:
        """The registered handler these options build for."""
        return handler_kind(self.handler)


def model_config(spec: ModelSpec, options: ServingOptions) -> dict:
    """The archive's model-config.yaml as a dict."""
    # torch.compile compiles inside initialize(); on a 2-core machine that
    # alone takes about a minute per model, past TorchServe's default 120 s
    # startup timeout once two workers start at once.
    # Nimble times every candidate at every bucket and may compile one.
    startup_timeout = 900 if spec.mode == "compile" or options.handler == "nimble" else 300
    # No minWorkers/maxWorkers: in an archive they override the register
    # API's initial_workers (TorchServe's ApiUtils.registerModel), which
    # would stop Packrat and users from choosing the worker count at
    # register time.
    config: dict[str, Any] = {
        "batchSize": options.batch_size,
        "maxBatchDelay": options.max_batch_delay_ms,
        "responseTimeout": options.response_timeout_s,
        "startupTimeout": startup_timeout,
        "handler": {
            "spec": spec.to_dict(),
            "max_payload_bytes": options.max_payload_bytes,
        },
    }
    if options.kind.asynchronous:
        config.update(asyncCommunication=True, batchSize=1, maxBatchDelay=0)
    if options.kind.settings is not None:
        config["handler"][options.handler] = dict(options.handler_settings)
        if options.worker_pump is not None:
            config["handler"]["worker_pump"] = options.worker_pump
        if options.encode_answers is not None:
            config["handler"]["encode_answers"] = options.encode_answers
    if options.decode_threads is not None:  # validated: async handlers, or the plain handler's 'batched'
        config["handler"]["decode_threads"] = options.decode_threads
    if options.cuda_graphs:
        config["handler"]["cuda_graphs"] = True
    if options.metrics_flush_interval_s is not None:
        config["handler"]["metrics_flush_interval_s"] = options.metrics_flush_interval_s
    if options.token_lengths:
        if spec.input_kind != "tokens":
            raise ValueError(f"{spec.name} takes images; token_lengths apply to token models")
        config["handler"]["token_lengths"] = list(parse_token_lengths(list(options.token_lengths), spec.seq_len))
    return config


def group_model_config(specs: list[ModelSpec], options: ServingOptions) -> dict:
    """A group archive's model-config.yaml: the first model's knobs, every model under ``handler.members``."""
    config = model_config(specs[0], options)
    del config["handler"]["spec"]
    config["handler"]["members"] = [{"spec": s.to_dict(), "artefact": f"weights-{s.name}.pt"} for s in specs]
    config["startupTimeout"] = 300 + 120 * (len(specs) - 1)  # every model is loaded and segmented at start
    return config

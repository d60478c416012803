"""Archives for a user's own model: a TorchScript file or a ``torch.export`` program, served by any handler here.

    packrat archive --serialized-file mynet.pt2 --name mynet --input image:3x224x224 --handler nimble

The catalog is one source of models; a serialized file is another.  The
model's description (a ``ModelSpec`` of family ``serialized``, its ``arch``
the file's format) is written into the archive's model-config.yaml like a
catalog model's, so every handler reads it the same way and loads the file
as it was saved.  Before anything is written the model is loaded here and
checked as the chosen handler would run it: it must run on the described
input at more than one batch size, answer each row as it answers that row
alone, and pass the handler's own checks (a graph that can be cut into
stages, a graph Nimble can trace).  A model that fails is refused in one line
naming why.
"""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from pathlib import Path

import torch

from archiver.build import is_current, run_archiver
from archiver.options import ServingOptions, model_config
from handlers.runtime.model_loading import load_model
from model_store import ARCHIVE_DIR
from model_store.catalog import SERIALIZED, CatalogError, ModelSpec, validate_spec
from model_store.factory import example_inputs, outputs_close

# The artefact's name inside the archive, by format (TorchServe's serializedFile).
ARTEFACT_NAMES = {"torchscript": "model.pt", "export": "model.pt2"}


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


def parse_input(text: str, vocab_size: int | None = None) -> dict:
    """``image:3x224x224`` or ``tokens:128`` (with ``vocab_size``) into the spec's input fields."""
    kind, _, shape = text.partition(":")
    if kind == "tokens" and vocab_size is None:
        raise ValueError("token input needs --vocab-size (ids at or above it are refused with a 400)")
    try:
        if kind == "image":
            return {"input_kind": "image", "image_shape": tuple(int(d) for d in shape.lower().split("x"))}
        if kind == "tokens":
            return {"input_kind": "tokens", "seq_len": int(shape), "vocab_size": int(vocab_size)}
    except ValueError:
        pass  # a malformed shape: the same one-line usage as an unknown kind
    raise ValueError(f"--input must be image:CxHxW (e.g. image:3x224x224) or tokens:LENGTH, got {text!r}")


def describe(path: Path, name: str, input_text: str, vocab_size: int | None = None) -> ModelSpec:
    """The model's description, checked as a catalog entry is (a bad one is refused in one line)."""
    spec = ModelSpec(
        name=name, family=SERIALIZED, arch=serialized_format(path), modes=("eager",),
        **parse_input(input_text, vocab_size),
    )  # fmt: skip
    try:
        validate_spec(spec)
    except CatalogError as exc:
        raise ValueError(str(exc)) from None
    return spec


def check_batches(spec: ModelSpec, model: torch.nn.Module) -> None:
    """Refuse a model that does not run on its described input at batch 1 and 3, or whose rows depend on
    their batch-mates: TorchServe and the handlers here batch requests as they come."""
    three = example_inputs(spec, batch=3, seed=1)
    try:
        with torch.inference_mode():
            together = model(*three)
            alone = [model(*(x[i : i + 1] for x in three)) for i in range(3)]
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{spec.name} does not run on {describe_input(spec)} at batch 1 and 3 ({first}); "
            "a torch.export program needs a dynamic batch dimension (dynamic_shapes={'x': {0: Dim('batch')}})"
        ) from None
    if not isinstance(together, torch.Tensor):
        raise ValueError(f"{spec.name} returns {type(together).__name__}; the handlers here serve one output tensor")
    if not outputs_close(torch.cat(alone), together, 1e-4):
        raise ValueError(f"{spec.name}: a row's answer depends on the other rows of its batch; it cannot be batched")


def describe_input(spec: ModelSpec) -> str:
    if spec.input_kind == "image":
        return "images of shape " + "x".join(str(d) for d in spec.image_shape)
    return f"token ids (input_ids, attention_mask) of length {spec.seq_len}"


def build_serialized_archive(
    path: Path,
    spec: ModelSpec,
    out_dir: Path = ARCHIVE_DIR,
    options: ServingOptions = ServingOptions(),
    force: bool = False,
) -> Path:
    """Write ``<out_dir>/<name>.mar`` (``<name>-<handler>.mar`` for a scheduling handler); returns its path."""
    kind = options.kind
    if kind.group:
        raise ValueError(f"the {kind.name} handler serves a group of models; archive the catalog's with --models")
    name = spec.name if kind.name == "plain" else f"{spec.name}-{kind.name}"
    target = out_dir / f"{name}.mar"
    if is_current(target, options) and not force:
        return target
    if kind.check_spec is not None:
        kind.check_spec(kind.name, spec)
    config = model_config(spec, options)  # refuses options that do not fit this model before it is loaded
    model = load_model(spec, str(path))
    check_batches(spec, model)
    if kind.check_model is not None:
        kind.check_model(spec, model, kind.parse_settings(dict(options.handler_settings)))
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"mar-{name}-") as tmp:
        workdir = Path(tmp)
        artefact = workdir / ARTEFACT_NAMES[spec.arch]
        shutil.copyfile(path, artefact)
        run_archiver(name, workdir, [artefact], config, options, out_dir, target)
    return target

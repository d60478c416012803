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
from pathlib import Path

import torch

from archiver.build import is_current, run_archiver
from archiver.options import ServingOptions, model_config
from handlers.runtime.model_loading import load_model
from model_store import ARCHIVE_DIR
from model_store.catalog import ModelSpec
from model_store.factory import example_inputs, outputs_close
from model_store.user_models import describe_input

# The artefact's name inside the archive, by format (TorchServe's serializedFile).
ARTEFACT_NAMES = {"torchscript": "model.pt", "export": "model.pt2"}


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
        raise ValueError(
            f"the {kind.name} handler serves a group of models: list yours under handler.members of a "
            "torch-model-archiver archive (docs/your_models.md), or archive the catalog's with --models"
        )
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

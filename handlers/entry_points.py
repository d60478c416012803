"""Every handler here, named from an archive the user builds with ``torch-model-archiver``.

TorchServe's ``--handler`` must be a file inside the archive, and a handler
module with a ``handle(data, context)`` function is one it accepts (called
once with ``data=None`` to initialise).  So the one line a user writes::

    # dvabatch_handler.py
    from handlers.entry_points import dvabatch as handle

    torch-model-archiver --model-name mynet --version 1.0 --serialized-file mynet.pt2 \\
        --handler dvabatch_handler.py --config-file model-config.yaml

puts the installed handler in charge of the archive, and the user's
``model-config.yaml`` describes the model in their own terms::

    asyncCommunication: true          # Ebird, DVABatch, REEF, Orca schedule requests themselves
    handler:
      input: image:3x224x224          # or tokens:128 with vocab_size: 30522
      dvabatch: {segments: 2}         # the handler's own settings, as `packrat archive --handler-config`

REEF takes its group as ``handler.members``, each ``{name, file, input}``
(the files passed with ``--extra-files``); Orca takes a GPT-2-family
checkpoint: the weights as the serialized file and the ``config.json``
``save_pretrained`` wrote beside them as an extra file.

At registration (the worker's initialise) the entry point turns that
description into the model's ``ModelSpec`` (``model_store/user_models.py``),
exactly as ``packrat archive`` would have written it, runs the handler's own
refusals from ``registry.py``, then hands the handler the context.  A model
the handler cannot serve is refused there with one line naming why: it is
the exception TorchServe writes to the model log as ``Failed to load model
NAME, exception <reason>``, and the registration answers 500.  An archive
``packrat archive`` built already carries its spec and goes straight through.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from handlers.registry import HandlerKind, handler_kind
from model_store.catalog import ModelSpec
from model_store.user_models import CHECKPOINT_CONFIG, describe, describe_checkpoint


class ModelRefused(RuntimeError):
    """The archive's model cannot be served by this handler; the message, one line, says why."""


def described(section: Mapping[str, Any], name: str, model_file: Path) -> dict[str, Any]:
    """The spec (as written in model-config.yaml) of ``model_file``, from the user's ``input`` description."""
    if "input" not in section:
        raise ModelRefused(
            f"{name}: model-config.yaml must describe the model's input under handler.input "
            "(image:CxHxW, or tokens:LENGTH with handler.vocab_size)"
        )
    return describe(model_file, name, section["input"], section.get("vocab_size")).to_dict()


def completed_section(kind: HandlerKind, section: Mapping[str, Any], model_name: str, model_dir: Path,
                      serialized_file: str | None) -> dict[str, Any]:  # fmt: skip
    """The ``handler:`` section with every model's spec filled in from the user's description."""
    out = dict(section)
    if kind.group:
        members = section.get("members")
        if not members or not isinstance(members, list):
            raise ModelRefused(f"the {kind.name} handler serves a group: list handler.members, each "
                               "{name, file, input} (files passed with --extra-files)")  # fmt: skip
        out["members"] = [member_entry(m, model_dir) for m in members]
        return out
    if "spec" in section:
        return out
    if not serialized_file:
        raise ModelRefused(f"{model_name}: the archive has no model file; pass it with --serialized-file")
    model_file = model_dir / serialized_file
    if kind.checkpoint:
        out["spec"] = describe_checkpoint(model_dir / CHECKPOINT_CONFIG, model_name).to_dict()
    else:
        out["spec"] = described(section, model_name, model_file)
    return out


def member_entry(member: Any, model_dir: Path) -> dict[str, Any]:
    """One group member as the REEF handler reads it: ``{spec, artefact}``."""
    if isinstance(member, Mapping) and "spec" in member:  # written by `packrat archive`
        return dict(member)
    if not isinstance(member, Mapping) or not {"name", "file"} <= set(member):
        raise ModelRefused(f"a group member must be {{name, file, input}}, got {member!r}")
    name, file = str(member["name"]), str(member["file"])
    if not (model_dir / file).is_file():
        raise ModelRefused(f"{name}: {file} is not in the archive; pass it with --extra-files")
    return {"spec": described(member, name, model_dir / file), "artefact": file}


def refuse_unservable(kind: HandlerKind, section: Mapping[str, Any]) -> None:
    """The handler's own refusals (``registry.py``), by the model's description alone."""
    if kind.check_spec is None:
        return
    entries = section["members"] if kind.group else [section]
    for entry in entries:
        spec = ModelSpec.from_dict(entry["spec"])
        kind.check_spec(kind.name, spec)


class HandlerEntry:
    """``handle(data, context)`` for one registered handler, as TorchServe calls a handler module's function."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.handler: Any = None

    def __call__(self, data: Any, context: Any) -> Any:
        if data is None:
            self.initialize(context)
            return None
        return self.handler.handle(data, context)

    def initialize(self, context: Any) -> None:
        kind = handler_kind(self.name)
        config = getattr(context, "model_yaml_config", None) or {}
        if kind.asynchronous and not config.get("asyncCommunication"):
            raise ModelRefused(
                f"the {kind.name} handler schedules requests itself: set asyncCommunication: true in model-config.yaml"
            )
        model = (context.manifest or {}).get("model", {})
        model_dir = Path(context.system_properties["model_dir"])
        try:
            section = completed_section(kind, config.get("handler") or {}, model.get("modelName") or self.name,
                                        model_dir, model.get("serializedFile"))  # fmt: skip
            refuse_unservable(kind, section)
        except ModelRefused:
            raise
        except ValueError as exc:  # a description or a handler check: already one line naming why
            raise ModelRefused(str(exc)) from None
        context.model_yaml_config = {**config, "handler": section}
        self.handler = kind.handler()
        self.handler.initialize(context)

    @property
    def initialized(self) -> bool:
        return bool(getattr(self.handler, "initialized", False))


plain = HandlerEntry("plain")
ebird = HandlerEntry("ebird")
dvabatch = HandlerEntry("dvabatch")
reef = HandlerEntry("reef")
nimble = HandlerEntry("nimble")
orca = HandlerEntry("orca")

__all__ = ["HandlerEntry", "ModelRefused", "dvabatch", "ebird", "nimble", "orca", "plain", "reef"]

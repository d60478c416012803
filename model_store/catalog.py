"""The model catalog: which models this project serves and how each is fed.

The catalog is the single description of a model that every other part reads:
the archive builder writes it into each archive's model-config.yaml, the
handler rebuilds the input pipeline from it, the profiler and the tests build
the very same seeded model from it.  Keeping it declarative (YAML, validated
here) means a new model is one entry, not code in four places.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

CATALOG_PATH = Path(__file__).with_name("catalog.yaml")

FAMILIES = ("torchvision", "unet", "bert", "distilbert", "gpt2", "llama")
IMAGE_FAMILIES = ("torchvision", "unet")
# A user's own model: not built from an architecture but loaded from the file its user saved
# (``archiver/serialized.py``); ``arch`` names the file's format.
SERIALIZED = "serialized"
SERIALIZED_FORMATS = ("torchscript", "export")
INPUT_KINDS = ("image", "tokens")
EXECUTION_MODES = ("eager", "script", "compile")


class CatalogError(ValueError):
    """The catalog (or a spec read back from an archive) is malformed."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One catalog entry, plus the execution mode an archive was built in.

    ``image_shape`` is ``(C, H, W)`` for image models; ``seq_len`` is the
    padded token length for text models.  Exactly one of the two is set.
    """

    name: str
    family: str
    arch: str
    input_kind: str
    seed: int = 0
    image_shape: tuple[int, int, int] | None = None
    seq_len: int | None = None
    num_labels: int | None = None
    # Token models outside the catalog families say their vocabulary (ids at or above it are refused).
    vocab_size: int | None = None
    modes: tuple[str, ...] = EXECUTION_MODES
    ci: bool = False
    mode: str = "eager"

    def with_mode(self, mode: str) -> ModelSpec:
        if mode not in self.modes:
            raise CatalogError(
                f"model {self.name!r} cannot be built in mode {mode!r}; allowed: {', '.join(self.modes)}"
            )
        return dataclasses.replace(self, mode=mode)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form written into an archive's model-config.yaml."""
        out = dataclasses.asdict(self)
        out["image_shape"] = list(self.image_shape) if self.image_shape else None
        out["modes"] = list(self.modes)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Inverse of :meth:`to_dict`, validated (archives may be hand-edited)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise CatalogError(f"unknown model spec keys: {sorted(unknown)}")
        data = dict(data)
        if data.get("image_shape") is not None:
            data["image_shape"] = tuple(int(x) for x in data["image_shape"])
        if "modes" in data:
            data["modes"] = tuple(data["modes"])
        spec = cls(**data)
        validate_spec(spec)
        return spec


def validate_spec(spec: ModelSpec) -> None:
    """Refuse a description no handler could serve, in one line naming what is wrong."""
    where = f"model {spec.name!r}"
    if spec.family == SERIALIZED:
        _validate_serialized(spec, where)
        return
    if spec.family not in FAMILIES:
        raise CatalogError(f"{where}: family must be one of {FAMILIES}, got {spec.family!r}")
    if spec.input_kind not in INPUT_KINDS:
        raise CatalogError(f"{where}: input kind must be one of {INPUT_KINDS}")
    if spec.mode not in EXECUTION_MODES:
        raise CatalogError(f"{where}: mode must be one of {EXECUTION_MODES}, got {spec.mode!r}")
    bad_modes = set(spec.modes) - set(EXECUTION_MODES)
    if bad_modes:
        raise CatalogError(f"{where}: unknown modes {sorted(bad_modes)}")
    if spec.input_kind == "image":
        shape = spec.image_shape
        if shape is None or len(shape) != 3 or shape[0] != 3 or min(shape) <= 0:
            raise CatalogError(f"{where}: image input needs shape [3, H, W], got {shape}")
        if spec.family not in IMAGE_FAMILIES:
            raise CatalogError(f"{where}: image input is only for {' and '.join(IMAGE_FAMILIES)} models")
    else:
        if spec.seq_len is None or spec.seq_len <= 0:
            raise CatalogError(f"{where}: token input needs a positive seq_len")
        if spec.family in IMAGE_FAMILIES:
            raise CatalogError(f"{where}: {spec.family} models take image input")


def _validate_serialized(spec: ModelSpec, where: str) -> None:
    if spec.arch not in SERIALIZED_FORMATS:
        raise CatalogError(f"{where}: a serialized model's format must be one of {SERIALIZED_FORMATS}")
    if spec.mode != "eager" or spec.modes != ("eager",):
        raise CatalogError(f"{where}: a serialized model runs as it was saved (mode 'eager')")
    if spec.input_kind == "image":
        shape = spec.image_shape
        if shape is None or len(shape) != 3 or min(shape) <= 0:
            raise CatalogError(f"{where}: image input needs a shape C x H x W, got {shape}")
    elif spec.input_kind == "tokens":
        if spec.seq_len is None or spec.seq_len <= 0 or spec.vocab_size is None or spec.vocab_size <= 0:
            raise CatalogError(f"{where}: token input needs a positive length and vocabulary size")
    else:
        raise CatalogError(f"{where}: input kind must be one of {INPUT_KINDS}")


def _parse_entry(name: str, entry: dict[str, Any], defaults: dict[str, Any]) -> ModelSpec:
    if not isinstance(entry, dict):
        raise CatalogError(f"model {name!r}: entry must be a mapping")
    inp = entry.get("input")
    if not isinstance(inp, dict) or "kind" not in inp:
        raise CatalogError(f"model {name!r}: missing input.kind")
    try:
        spec = ModelSpec(
            name=name,
            family=entry["family"],
            arch=entry["arch"],
            input_kind=inp["kind"],
            seed=int(entry.get("seed", defaults.get("seed", 0))),
            image_shape=tuple(int(x) for x in inp["shape"]) if "shape" in inp else None,
            seq_len=int(inp["seq_len"]) if "seq_len" in inp else None,
            num_labels=entry.get("num_labels"),
            modes=tuple(entry.get("modes", defaults.get("modes", EXECUTION_MODES))),
            ci=bool(entry.get("ci", False)),
        )
    except KeyError as exc:
        raise CatalogError(f"model {name!r}: missing key {exc.args[0]!r}") from None
    validate_spec(spec)
    return spec


def load_catalog(path: str | Path = CATALOG_PATH) -> dict[str, ModelSpec]:
    """Read and validate the catalog; returns specs by model name."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("models"), dict):
        raise CatalogError(f"{path}: expected a mapping with a 'models' section")
    defaults = raw.get("defaults") or {}
    return {name: _parse_entry(name, entry, defaults) for name, entry in raw["models"].items()}


def get_spec(name: str, mode: str = "eager", path: str | Path = CATALOG_PATH) -> ModelSpec:
    """The catalog entry ``name`` in execution mode ``mode``."""
    catalog = load_catalog(path)
    if name not in catalog:
        raise CatalogError(f"unknown model {name!r}; the catalog has: {', '.join(catalog)}")
    return catalog[name].with_mode(mode)

"""Profiles: measured single-instance latency ``L[t][b]`` of one model.

The file format is plain JSON (DESIGN.md, "Packrat, concretely")::

    {"model": "resnet50", "mode": "script",
     "hardware": {"cpu_model": ..., "logical_cores": ..., "physical_cores": ...,
                  "sockets": ..., "torch": ...},
     "grid": {"threads": [1, 2], "batches": [1, 2, 4]},
     "points": [{"threads": 1, "batch": 1, "latency_ms": 41.2,
                 "p50_ms": ..., "p99_ms": ..., "iters": 20}, ...],
     "complete": true, "command": "packrat profile ..."}

Extra keys are allowed and kept.  A profile is tied to the machine it was
measured on: latencies are meaningless on another CPU, so loading checks the
hardware fingerprint and refuses a mismatch unless forced.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving_harness.jsonfile import write_json_atomic
from serving_harness.machine import fingerprint_differences


class ProfileError(ValueError):
    """A profile file is malformed, incomplete, or from other hardware."""


@dataclass(frozen=True, order=True)
class ProfilePoint:
    threads: int
    batch: int
    latency_ms: float
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_dict(self) -> dict[str, Any]:
        return {"threads": self.threads, "batch": self.batch, "latency_ms": self.latency_ms, **self.extra}

    @property
    def passes_ms(self) -> list[float]:
        """The latency of each pass the point has had (a one-pass point: its latency)."""
        return [float(v) for v in self.extra.get("pass_ms") or [self.latency_ms]]


HANDLER_KEY = "handler"  # top-level key of the handler's per-request cost (handler_cost.py)


@dataclass(frozen=True)
class HandlerCost:
    """What the serving handler spends per request besides the model (ms), by
    intra-op thread count; measured by ``packrat_plugin.handler_cost``."""

    per_request_ms: dict[int, float]
    requests: int = 0  # requests timed per thread count

    def to_dict(self) -> dict[str, Any]:
        return {
            "per_request_ms": {str(t): round(ms, 3) for t, ms in sorted(self.per_request_ms.items())},
            "requests": self.requests,
            "measures": "PlainModelHandler preprocess (decode) + collate + postprocess (encode), per request",
        }

    @classmethod
    def from_dict(cls, data: Any) -> HandlerCost:
        if not isinstance(data, dict) or not isinstance(data.get("per_request_ms"), dict):
            raise ProfileError(f"'{HANDLER_KEY}' needs a 'per_request_ms' object")
        out: dict[int, float] = {}
        for key, value in data["per_request_ms"].items():
            threads = int(key) if isinstance(key, str) and key.isdigit() else 0
            if threads < 1 or isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ProfileError(f"'{HANDLER_KEY}' has a bad per-request cost {key!r}: {value!r}")
            out[threads] = float(value)
        return cls(out, int(data.get("requests") or 0))


# Keys whose mismatch makes a profile invalid on this machine.


@dataclass(frozen=True)
class Profile:
    model: str
    points: tuple[ProfilePoint, ...]
    hardware: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def threads(self) -> list[int]:
        return sorted({p.threads for p in self.points})

    @property
    def batches(self) -> list[int]:
        return sorted({p.batch for p in self.points})

    def latency(self, threads: int, batch: int) -> float:
        for p in self.points:
            if p.threads == threads and p.batch == batch:
                return p.latency_ms
        raise KeyError(f"no profiled point at threads={threads}, batch={batch}")

    @property
    def handler(self) -> HandlerCost | None:
        """The handler's measured per-request cost; None for a profile of the model alone."""
        raw = self.meta.get(HANDLER_KEY)
        return None if raw is None else HandlerCost.from_dict(raw)

    def digest(self) -> tuple:
        """Hashable identity of the measurements (cache key for the optimizer)."""
        return (self.model, tuple((p.threads, p.batch, p.latency_ms) for p in sorted(self.points)))

    def to_dict(self, grid: dict[str, list[int]] | None = None) -> dict[str, Any]:
        """``grid`` overrides the one read off the points (a partial profile's
        grid is what was asked for, not what was measured so far)."""
        return {
            **self.meta,
            "model": self.model,
            "hardware": self.hardware,
            "grid": grid or {"threads": self.threads, "batches": self.batches},
            "points": [p.to_dict() for p in sorted(self.points)],
        }

    def save(self, path: str | Path, grid: dict[str, list[int]] | None = None) -> None:
        write_json_atomic(Path(path), self.to_dict(grid))


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ProfileError(f"{what} must be a positive integer, got {value!r}")
    return value


def parse_points(raw: Iterable[Any]) -> tuple[ProfilePoint, ...]:
    points = []
    seen: set[tuple[int, int]] = set()
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ProfileError(f"point {i} is not an object")
        try:
            threads = _as_int(item["threads"], f"point {i} threads")
            batch = _as_int(item["batch"], f"point {i} batch")
            latency = item["latency_ms"]
        except KeyError as exc:
            raise ProfileError(f"point {i} lacks {exc.args[0]!r}") from None
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not latency > 0:
            raise ProfileError(f"point {i} (threads={threads}, batch={batch}) has non-positive latency {latency!r}")
        if latency == float("inf"):
            raise ProfileError(f"point {i} has infinite latency")
        if (threads, batch) in seen:
            raise ProfileError(f"duplicate point threads={threads}, batch={batch}")
        seen.add((threads, batch))
        extra = {k: v for k, v in item.items() if k not in ("threads", "batch", "latency_ms")}
        points.append(ProfilePoint(threads, batch, float(latency), extra))
    return tuple(points)


def validate_grid(points: tuple[ProfilePoint, ...], grid: dict[str, Any] | None) -> None:
    """Every (threads, batch) of the grid must be measured: the optimizer's
    answer is only exact over the points it sees, so a hole is an error."""
    if not points:
        raise ProfileError("profile has no points")
    threads = sorted({p.threads for p in points}) if grid is None else grid.get("threads")
    batches = sorted({p.batch for p in points}) if grid is None else grid.get("batches")
    if not isinstance(threads, list) or not isinstance(batches, list):
        raise ProfileError("grid needs 'threads' and 'batches' lists")
    have = {(p.threads, p.batch) for p in points}
    missing = [(t, b) for t in threads for b in batches if (t, b) not in have]
    if missing:
        shown = ", ".join(f"(threads={t}, batch={b})" for t, b in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ProfileError(f"profile is missing {len(missing)} point(s): {shown}{more}")
    outside = have - {(t, b) for t in threads for b in batches}
    if outside:
        raise ProfileError(f"points outside the declared grid: {sorted(outside)[:5]}")


def profile_from_dict(data: Any, allow_incomplete: bool = False) -> Profile:
    if not isinstance(data, dict):
        raise ProfileError("profile must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise ProfileError("profile lacks a 'model' name")
    if not isinstance(data.get("points"), list):
        raise ProfileError("profile lacks a 'points' list")
    points = parse_points(data["points"])
    if not allow_incomplete:
        validate_grid(points, data.get("grid"))
    meta = {k: v for k, v in data.items() if k not in ("model", "hardware", "grid", "points")}
    if HANDLER_KEY in meta:
        HandlerCost.from_dict(meta[HANDLER_KEY])  # a malformed one is refused here, not mid-plan
    return Profile(model, points, dict(data.get("hardware") or {}), meta)


def check_hardware(profile: Profile, current: dict[str, Any] | None = None) -> None:
    diffs = fingerprint_differences(profile.hardware, current)
    if diffs:
        raise ProfileError(
            f"profile of {profile.model} was measured on other hardware ({'; '.join(diffs)}); "
            "re-profile here, or pass force=True / --force to use it anyway"
        )


def load_profile(
    path: str | Path, check_machine: bool = True, force: bool = False, allow_incomplete: bool = False
) -> Profile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"no profile at {path}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: malformed JSON: {exc.msg} at line {exc.lineno}") from None
    try:
        profile = profile_from_dict(data, allow_incomplete=allow_incomplete)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None
    if check_machine and not force:
        check_hardware(profile)
    return profile

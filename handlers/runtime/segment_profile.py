"""Per-segment latency over batch sizes: what stage schedulers plan with.

DVABatch splits a batch at a stage when the time left for the whole batch is
at least twice the time left for half of it; REEF lets a best-effort segment
run beside a real-time one only if it is the shorter.  Both read the time of
segment ``s`` at batch ``b``, measured on this machine at this thread count,
which is what this file holds::

    {"model": "bert-base", "segments": 4, "threads": 2,
     "batches": [1, 2, 4, 8], "times_ms": [[...per batch...], ...per segment...],
     "hardware": {...}, "command": "packrat segments ..."}

Like a Packrat profile it is tied to the machine it was measured on, and
loading refuses another machine's file unless forced.
"""

from __future__ import annotations

import bisect
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from handlers.runtime.segments import SegmentedModel, State, dynamic_dims_for, slice_model
from serving_harness.machine import fingerprint_differences, hardware_fingerprint


class ProfileError(ValueError):
    """A segment profile is malformed or was measured on other hardware."""


@dataclass(frozen=True)
class SegmentProfile:
    model: str
    threads: int
    batches: tuple[int, ...]
    times_ms: tuple[tuple[float, ...], ...]  # [segment][index into batches]
    hardware: dict[str, Any] = field(default_factory=dict)
    command: str = ""

    def __post_init__(self) -> None:
        if not self.batches or list(self.batches) != sorted(set(self.batches)) or self.batches[0] < 1:
            raise ProfileError(f"batches must be increasing positive sizes, got {list(self.batches)}")
        if not self.times_ms or any(len(row) != len(self.batches) for row in self.times_ms):
            raise ProfileError("times_ms needs one time per batch size for every segment")
        if any(not (t >= 0.0) for row in self.times_ms for t in row):
            raise ProfileError("segment times must be non-negative numbers")

    @property
    def segments(self) -> int:
        return len(self.times_ms)

    def ms(self, segment: int, batch: int) -> float:
        """Segment time at ``batch``: measured, linear between measured sizes, extrapolated beyond."""
        row, sizes = self.times_ms[segment], self.batches
        if batch <= sizes[0]:
            return row[0] * batch / sizes[0]
        i = bisect.bisect_left(sizes, batch)
        if i < len(sizes) and sizes[i] == batch:
            return row[i]
        lo, hi = (i - 1, i) if i < len(sizes) else (len(sizes) - 2, len(sizes) - 1)
        if lo < 0:  # a single measured size
            return row[0] * batch / sizes[0]
        slope = (row[hi] - row[lo]) / (sizes[hi] - sizes[lo])
        return max(0.0, row[lo] + slope * (batch - sizes[lo]))

    def remaining_ms(self, first_segment: int, batch: int) -> float:
        """Time to finish a batch that stands before ``first_segment`` (DVABatch's T_remain)."""
        return sum(self.ms(s, batch) for s in range(first_segment, self.segments))

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "segments": self.segments,
            "threads": self.threads,
            "batches": list(self.batches),
            "times_ms": [[round(t, 4) for t in row] for row in self.times_ms],
            "hardware": self.hardware,
            "command": self.command,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SegmentProfile:
        try:
            profile = cls(
                model=str(data["model"]),
                threads=int(data["threads"]),
                batches=tuple(int(b) for b in data["batches"]),
                times_ms=tuple(tuple(float(t) for t in row) for row in data["times_ms"]),
                hardware=dict(data.get("hardware", {})),
                command=str(data.get("command", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ProfileError):
                raise
            raise ProfileError(f"malformed segment profile: {exc!r}") from None
        if "segments" in data and int(data["segments"]) != profile.segments:
            raise ProfileError(f"says {data['segments']} segments but times {profile.segments}")
        return profile

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def load_segment_profile(path: Path, force: bool = False) -> SegmentProfile:
    try:
        profile = SegmentProfile.from_dict(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise ProfileError(f"no segment profile at {path}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: malformed JSON: {exc.msg}") from None
    if not force:
        diffs = fingerprint_differences(profile.hardware)  # the same rule as a Packrat profile's
        if diffs:
            raise ProfileError(
                f"segment profile of {profile.model} was measured on other hardware ({'; '.join(diffs)}); "
                "re-profile here, or pass force=True to use it anyway"
            )
    return profile


def measure_segments(
    sliced: SegmentedModel,
    make_inputs: Callable[[int], tuple[torch.Tensor, ...]],
    batches: Sequence[int],
    model: str,
    warmup: int = 2,
    iters: int = 5,
    command: str = "",
    progress: bool = True,
    min_ms: float = 0.0,
    max_iters: int = 200,
) -> SegmentProfile:
    """Median time of each segment at each batch size, run in order on real states (``measure_classes``)."""
    (profile,) = measure_classes(
        sliced, [make_inputs], batches, model, warmup, iters, command, progress, min_ms, max_iters
    )
    return profile


def measure_classes(
    sliced: SegmentedModel,
    inputs_by_class: Sequence[Callable[[int], tuple[torch.Tensor, ...]]],
    batches: Sequence[int],
    model: str,
    warmup: int = 2,
    iters: int = 5,
    command: str = "",
    progress: bool = True,
    min_ms: float = 0.0,
    max_iters: int = 200,
    run_stages: Sequence[Callable[[int, State], State]] | None = None,
) -> list[SegmentProfile]:
    """A profile per input class (DVABatch's token lengths), their runs interleaved round by round.

    Profiles that are compared with each other are measured together: one
    class timed after another reads the machine's drift (clock, neighbours)
    as a difference between them, and on millisecond stages that drift was
    as large as the difference sought.  Each (class, size) runs ``iters``
    times, and more, up to ``max_iters``, until its timed runs add up to
    ``min_ms``: a model whose batch takes a millisecond gets enough samples
    for a steady median at no cost to one whose batch takes seconds.
    ``run_stages[c](s, state)`` runs stage ``s`` of class ``c`` as the server
    runs it (DVABatch's traced buckets, each class's own); by default the
    sliced model's own segment.
    """
    own = [lambda s, state: sliced[s](state)] * len(inputs_by_class)
    stages = own if run_stages is None else list(run_stages)
    pairs = [(c, j) for c in range(len(inputs_by_class)) for j in range(len(batches))]
    samples = {pair: [[] for _ in range(len(sliced))] for pair in pairs}
    timed_ms = dict.fromkeys(pairs, 0.0)
    bar = tqdm(total=len(pairs), desc=f"segments of {model}", unit="batch", disable=not progress)

    def wanted(pair: tuple[int, int], i: int) -> bool:
        return i < warmup + iters or (timed_ms[pair] < min_ms and i < warmup + max_iters)

    with torch.no_grad(), bar:
        i = 0
        while running := [pair for pair in pairs if wanted(pair, i)]:
            for c, j in running:
                state: State = sliced.start(*inputs_by_class[c](batches[j]))
                for s in range(len(sliced)):
                    started = time.perf_counter()
                    state = stages[c](s, state)
                    if i >= warmup:
                        samples[c, j][s].append(1e3 * (time.perf_counter() - started))
                        timed_ms[c, j] += samples[c, j][s][-1]
            i += 1
            bar.n = len(pairs) - sum(wanted(pair, i) for pair in pairs)
            bar.refresh()
    threads, hardware = torch.get_num_threads(), hardware_fingerprint()
    return [
        SegmentProfile(
            model=model,
            threads=threads,
            batches=tuple(batches),
            times_ms=tuple(
                tuple(statistics.median(samples[c, j][s]) for j in range(len(batches))) for s in range(len(sliced))
            ),
            hardware=hardware,
            command=command,
        )
        for c in range(len(inputs_by_class))
    ]


def slice_catalog_model(spec: Any, model: torch.nn.Module, segments: int, repeats: int = 1) -> SegmentedModel:
    """A catalog model cut as the builder checks it and the tools time it: on its example batch of 2,
    with its dynamic dimensions, refused unless the pieces reproduce the model (``outputs_close``, 1e-4)."""
    from model_store.factory import example_inputs, outputs_close

    return slice_model(
        model, example_inputs(spec, 2), segments, dynamic_dims_for(spec.input_kind), repeats=repeats,
        check=lambda got, expected: outputs_close(got, expected, 1e-4),
    )  # fmt: skip


# -- `packrat segments` ---------------------------------------------------------------

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "profiles" / "segments"


def default_path(model: str, segments: int) -> Path:
    return DEFAULT_DIR / f"{model}-{segments}seg.json"


def add_arguments(parser: Any) -> None:
    parser.add_argument("model", help="catalog name")
    parser.add_argument("--segments", "-n", type=int, default=4, help="pieces to cut the model into")
    parser.add_argument("--batches", default="1,2,4,8", help="batch sizes to time each segment at")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="default profiles/segments/MODEL-Nseg.json")


def run(args: Any) -> int:
    """Slice a catalog model into time-balanced segments, check it, time each segment, save."""
    from model_store.catalog import get_spec
    from model_store.factory import build_model, example_inputs

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = sorted({int(b) for b in str(args.batches).split(",") if b.strip()})
    if not batches or batches[0] < 1:
        raise ProfileError(f"--batches needs positive sizes, got {args.batches!r}")
    spec = get_spec(args.model)
    sliced = slice_catalog_model(spec, build_model(spec), args.segments, repeats=3)
    command = (
        f"packrat segments {spec.name} --segments {args.segments} --batches {','.join(map(str, batches))} "
        f"--threads {torch.get_num_threads()} --warmup {args.warmup} --iters {args.iters}"
    )
    profile = measure_segments(
        sliced, lambda b: example_inputs(spec, b), batches, spec.name, args.warmup, args.iters, command
    )
    path = profile.save(args.out or default_path(spec.name, args.segments))
    for s in range(profile.segments):
        row = ", ".join(f"b={b}: {profile.ms(s, b):.1f} ms" for b in profile.batches)
        print(f"segment {s} ({sliced[s].nodes} nodes): {row}")
    print(f"wrote {path}")
    return 0

"""Nimble's settings (``handler.nimble`` in model-config.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from handlers.settings import known_settings

# How the worker picks a program for each bucket: "auto" times every
# candidate at the bucket's size when the worker starts and keeps the
# fastest (eager included, so never slower than eager as measured);
# "multi" / "single" force the multi-stream (CPU: chains on threads) or the
# one-stream ahead-of-time program; "eager" turns Nimble off, for comparison.
STREAMS = ("auto", "multi", "single", "eager")
# The candidates ``auto`` chooses among, by name (docs, logs, benchmarks).
# COMPILED is the frozen graph compiled by inductor: on CPU as it is (the CPU's
# analogue of a captured graph), on CUDA captured per bucket like SINGLE.  Was: the CPU's
# nearest thing to a captured CUDA graph (generated code, no per-operator
# dispatch from Python).
EAGER, SINGLE, MULTI, COMPILED = "eager", "single", "multi", "compiled"


class NimbleConfigError(ValueError):
    pass


@dataclass(frozen=True)
class NimbleConfig:
    # Batch sizes prepared ahead of time.  On CUDA each is a captured graph and
    # a batch of n is padded to the smallest bucket ≥ n; on CPU the program is
    # shape-generic and n runs unpadded with its bucket's choice.  A batch
    # above the largest bucket runs eager (logged).  Every bucket costs
    # start-up time (each candidate is timed), so the default stops at 8.
    buckets: tuple[int, ...] = (1, 2, 4, 8)
    streams: str = "auto"
    timing_runs: int = 3  # timed runs per candidate and bucket (after one warm-up), median kept
    # A prepared program replaces eager only when its start-up time is at least
    # this fraction below eager's: three timed runs on a busy machine differ
    # by a few per cent, and a coin toss should not pick the unproven path.
    min_gain: float = 0.03
    # CPU: intra-op threads for each side chain's thread (chain 0 keeps the worker's).
    side_threads: int = 1
    # CPU, streams "auto": also try the frozen graph under torch.compile.  It
    # compiles at start-up (about half a minute per model on 2 cores, once
    # more for a second batch size), which is why it can be turned off.
    cpu_compile: bool = True
    # CUDA, streams "auto": also try the frozen graph compiled by inductor
    # (fused kernels, static shapes) and captured into Nimble's own CUDA
    # graph per bucket.  That is what torch.compile(mode="reduce-overhead")
    # serves, kernels and replay alike, so with it among the candidates the
    # choice is never slower than the compiler at start-up.  It compiles once
    # per bucket at start-up; false leaves it out.
    cuda_compile: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.buckets, str | bytes) or not self.buckets:
            raise NimbleConfigError(f"buckets must be a non-empty list of batch sizes, got {self.buckets!r}")
        for b in self.buckets:
            if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 1024:
                raise NimbleConfigError(f"every bucket must be an integer in 1..1024, got {b!r}")
        if list(self.buckets) != sorted(set(self.buckets)):
            raise NimbleConfigError(f"buckets must be increasing and distinct, got {list(self.buckets)}")
        if self.streams not in STREAMS:
            raise NimbleConfigError(f"streams must be one of {', '.join(STREAMS)}, got {self.streams!r}")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, int | float) or not 0 <= self.min_gain < 1:
            raise NimbleConfigError(f"min_gain must be a number in [0, 1), got {self.min_gain!r}")
        for name in ("cpu_compile", "cuda_compile"):
            if not isinstance(getattr(self, name), bool):
                raise NimbleConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("timing_runs", "side_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise NimbleConfigError(f"{name} must be an integer ≥ 1, got {value!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> NimbleConfig:
        raw = known_settings(cls, raw, "nimble", NimbleConfigError)
        if isinstance(raw.get("buckets"), list | tuple):
            raw["buckets"] = tuple(raw["buckets"])
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["buckets"] = list(self.buckets)
        return out

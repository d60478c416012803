"""A GPU's streaming multiprocessors split in two: real-time work on one part, best-effort on the other.

Why: priority streams order *launches*, not the SMs a kernel already holds.
A best-effort kernel that filled the GPU keeps its SMs until its blocks end,
so a real-time kernel launched beside it waits for them or runs on what is
left: on the lent H100/H200 REEF's RT mean stayed 14-18 % above RT alone
with priority streams and preemption at segment bounds.  A CUDA *green
context* is a context over a fixed subset of the SMs: RT kernels on one
green context and BE kernels on another, made from one split of the
device's SMs, never share an SM, so BE cannot be in RT's way at all.  The
price is the other way round: RT alone runs on its part only, and BE never
uses RT's SMs even when RT is idle.  The split is therefore sized from the
RT model (``measure_rt_sms``): the fewest SMs on which its batch runs
within a tolerance of its time on the whole GPU.

Mechanism only, through ``cuda.bindings`` (CUDA driver ≥ 12.8, the
``cuda-bindings`` package PyTorch's CUDA wheels install).  PyTorch's own
``torch.cuda.green_contexts.GreenContext`` takes the first ``n`` SMs each
time it is made, so two of them overlap; here both sides come from the same
``cuDevSmResourceSplitByCount`` call (its result and its remainder), which
the driver guarantees disjoint.  Streams are made on each green context
with a priority and handed to PyTorch as ``torch.cuda.ExternalStream``.

The pure parts (how many SMs a request becomes, which measured partition to
keep) are plain functions, tested on CPU; the rest needs a GPU.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DRIVER_NEEDED = 12080  # green contexts: CUDA driver 12.8


class GreenContextsUnavailable(RuntimeError):
    """This process cannot make green contexts; the message says why."""


@dataclass(frozen=True)
class SmGrid:
    """How a device's SMs may be split: their number, the smallest group and the step between group sizes."""

    total: int
    minimum: int
    step: int

    def rt_counts(self) -> list[int]:
        """Every RT group size the driver can make that leaves BE at least ``minimum`` SMs."""
        return list(range(self.minimum, self.total - self.minimum + 1, self.step))

    def rounded(self, requested: int) -> int:
        """The RT group ``requested`` SMs becomes: rounded up to a size the driver makes, BE keeping its minimum."""
        counts = self.rt_counts()
        if not counts:
            raise ValueError(f"a device of {self.total} SMs cannot be split in two (groups of ≥ {self.minimum})")
        if requested < 1:
            raise ValueError(f"an RT partition needs at least one SM, got {requested}")
        return next((n for n in counts if n >= requested), counts[-1])


def candidates(grid: SmGrid, points: int = 8) -> list[int]:
    """At most ``points`` RT group sizes, evenly spread over what the grid allows, smallest first."""
    counts = grid.rt_counts()
    if len(counts) <= points:
        return counts
    picks = {counts[round(i * (len(counts) - 1) / (points - 1))] for i in range(points)}
    return sorted(picks)


def choose_rt_sms(whole_gpu_ms: float, timings: dict[int, float], tolerance: float = 1.05) -> int:
    """The fewest SMs whose measured RT batch time is within ``tolerance`` of the whole GPU's.

    None within it: the largest partition measured (RT then loses the least
    that a split can give it).
    """
    if not timings:
        raise ValueError("no partition was measured")
    within = [n for n, ms in timings.items() if ms <= whole_gpu_ms * tolerance]
    return min(within) if within else max(timings)


def _ok(result: tuple):  # noqa: ANN202 - cuda.bindings' own result types
    """A ``cuda.bindings`` call's outputs, raising on its status."""
    from cuda.bindings import driver

    status, *outputs = result
    if status != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(status)
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if isinstance(name, bytes) else name}")
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def unavailable_reason(device: torch.device) -> str | None:
    """Why green contexts cannot be made on ``device`` here, or None when they can."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "they need a CUDA device"
    if torch.version.hip is not None:
        return "they are a CUDA feature (this is ROCm)"
    try:
        from cuda.bindings import driver
    except ImportError:
        return "the cuda-bindings package is not installed"
    torch.cuda.init()
    version = _ok(driver.cuDriverGetVersion())
    if version < DRIVER_NEEDED:
        return f"they need CUDA driver 12.8 or newer; this one is {version // 1000}.{version % 1000 // 10}"
    return None


def sm_grid(device_index: int) -> SmGrid:
    """The device's SM count and the granularity its splits follow (read from the driver)."""
    from cuda.bindings import driver

    device = _ok(driver.cuDeviceGet(device_index))
    resource = _ok(driver.cuDeviceGetDevResource(device, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    sm = resource.sm
    # The driver's documented limits for compute capability 9.x and later (8 SMs, in steps of 8); its resource
    # says so itself from CUDA 13 (``minSmPartitionSize``, ``smCoscheduledAlignment``).
    minimum = int(getattr(sm, "minSmPartitionSize", 0) or 0) or 8
    step = int(getattr(sm, "smCoscheduledAlignment", 0) or 0) or minimum
    return SmGrid(total=int(sm.smCount), minimum=minimum, step=step)


class GreenPartition:
    """Two disjoint green contexts on one device, RT's of ``rt_sms`` SMs and BE's of the rest, and their streams.

    Keep the object alive as long as its streams are used; ``close`` destroys
    streams and contexts (after the work on them is done).
    """

    def __init__(self, device_index: int, rt_sms: int) -> None:
        from cuda.bindings import driver

        self._driver = driver
        torch.cuda.init()
        with torch.cuda.device(device_index):
            torch.cuda.current_stream().synchronize()  # the primary context exists and is current on this thread
        self.device_index = device_index
        device = _ok(driver.cuDeviceGet(device_index))
        whole = _ok(driver.cuDeviceGetDevResource(device, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        groups, made, rest = _ok(driver.cuDevSmResourceSplitByCount(1, whole, 0, rt_sms))
        if made != 1:
            raise RuntimeError(f"the driver made {made} SM groups of ≥ {rt_sms}, not one")
        self.rt_sms = int(groups[0].sm.smCount)
        self.be_sms = int(rest.sm.smCount)
        self.total_sms = int(whole.sm.smCount)
        if self.be_sms < 1:
            raise RuntimeError(f"{self.rt_sms} SMs for real-time work leave none of {self.total_sms} for the rest")
        self._contexts = {}
        self._streams: list = []
        try:
            for side, resource in (("rt", groups[0]), ("be", rest)):
                desc = _ok(driver.cuDevResourceGenerateDesc([resource], 1))
                self._contexts[side] = _ok(
                    driver.cuGreenCtxCreate(desc, device, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
                )
        except Exception:
            self.close()
            raise

    def stream(self, side: str, priority: int = 0) -> torch.cuda.ExternalStream:
        """A new stream on the ``"rt"`` or ``"be"`` green context, at ``priority`` (lower is more urgent)."""
        handle = _ok(
            self._driver.cuGreenCtxStreamCreate(
                self._contexts[side], self._driver.CUstream_flags.CU_STREAM_NON_BLOCKING, priority
            )
        )
        self._streams.append(handle)
        return torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", self.device_index))

    def close(self) -> None:
        """Destroy the streams, then the contexts (each once)."""
        for handle in self._streams:
            self._driver.cuStreamDestroy(handle)
        self._streams.clear()
        for context in self._contexts.values():
            self._driver.cuGreenCtxDestroy(context)
        self._contexts.clear()

    def __repr__(self) -> str:
        return f"GreenPartition(cuda:{self.device_index}: RT {self.rt_sms} SMs, BE {self.be_sms} of {self.total_sms})"


def _median_ms(stream: torch.cuda.Stream, run: Callable[[], None], repeats: int) -> float:
    """The median time of ``run`` on ``stream``, from CUDA events around each call (one warm-up call first)."""
    times = []
    with torch.cuda.stream(stream):
        run()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            run()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


@dataclass(frozen=True)
class RtSizing:
    """What ``measure_rt_sms`` measured and chose."""

    rt_sms: int
    whole_gpu_ms: float
    timings: dict[int, float]  # RT SMs -> the RT batch's median time there

    def describe(self) -> str:
        there = self.timings.get(self.rt_sms, math.nan)
        return (
            f"{self.rt_sms} SMs for real-time work: its batch {there:.2f} ms there against {self.whole_gpu_ms:.2f} ms "
            f"on the whole GPU (measured at {', '.join(str(n) for n in sorted(self.timings))} SMs)"
        )


def measure_rt_sms(device_index: int, run: Callable[[], None], tolerance: float = 1.05, repeats: int = 20) -> RtSizing:
    """Time ``run`` (the RT models' batch) on the whole GPU, then on RT partitions from the smallest up; keep
    the first within ``tolerance`` of the whole GPU's time (``choose_rt_sms``)."""
    device = torch.device("cuda", device_index)
    whole = _median_ms(torch.cuda.Stream(device), run, repeats)
    timings: dict[int, float] = {}
    for count in candidates(sm_grid(device_index)):
        partition = GreenPartition(device_index, count)
        try:
            timings[partition.rt_sms] = _median_ms(partition.stream("rt"), run, repeats)
        finally:
            torch.cuda.synchronize(device)
            partition.close()
        if timings[partition.rt_sms] <= whole * tolerance:
            break
    return RtSizing(choose_rt_sms(whole, timings, tolerance), whole, timings)

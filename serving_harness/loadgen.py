"""One async load generator for every benchmark (aiohttp, loopback only).

Closed loop: ``concurrency`` clients each send a request, wait for its answer,
send the next, until the duration ends; the number in flight is exactly the
concurrency, which is how a Packrat benchmark holds B requests in the system.

Open loop: arrivals follow a schedule of phases ``(seconds, rate)``
(uniform or Poisson inter-arrival gaps) regardless of how fast answers come,
so queueing shows up as latency.  Step and diurnal loads are schedules.

Either may be given ``until``, a ``threading.Event`` another thread sets to
end the load early (a test that loads a server until it sees a swap): no
new request is sent once it is set, and those in flight are awaited and
counted as any other.

Every request is accounted for: its send time, latency and status; a
connection error or timeout is recorded as status 0, never dropped.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

Payload = bytes | dict


@dataclass(frozen=True)
class Sample:
    sent: float  # seconds since the load started
    latency_s: float
    status: int  # HTTP status; 0 = connection error or timeout


@dataclass
class LoadResult:
    samples: list[Sample]
    wall_s: float

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.status == 200]

    @property
    def failed(self) -> int:
        return sum(s.status != 200 for s in self.samples)

    def mean_latency_ms(self) -> float:
        ok = self.ok
        return 1e3 * sum(s.latency_s for s in ok) / len(ok) if ok else math.nan

    def percentile_ms(self, q: float) -> float:
        lat = sorted(s.latency_s for s in self.ok)
        if not lat:
            return math.nan
        return 1e3 * lat[min(len(lat) - 1, round(q / 100 * (len(lat) - 1)))]

    def throughput(self) -> float:
        return len(self.ok) / self.wall_s if self.wall_s > 0 else 0.0


def _encode(payload: Payload) -> tuple[bytes, str]:
    if isinstance(payload, dict):
        import json

        return json.dumps(payload).encode(), "application/json"
    return payload, "application/octet-stream"


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    payload: Payload,
    t0: float,
    out: list[Sample],
    headers: dict[str, str] | None = None,
) -> None:
    body, content_type = _encode(payload)
    sent = time.perf_counter()
    try:
        async with session.post(url, data=body, headers={"Content-Type": content_type, **(headers or {})}) as resp:
            await resp.read()
            status = resp.status
    except (TimeoutError, aiohttp.ClientError):
        status = 0
    out.append(Sample(sent - t0, time.perf_counter() - sent, status))


def _session(timeout_s: float, limit: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s), connector=aiohttp.TCPConnector(limit=limit)
    )


async def closed_loop(
    url: str,
    payloads: Callable[[int], Payload],
    concurrency: int,
    duration_s: float,
    timeout_s: float = 300.0,
    headers: dict[str, str] | None = None,
    until: threading.Event | None = None,
) -> LoadResult:
    """``concurrency`` clients for ``duration_s`` seconds, or until ``until`` is set if that comes first."""
    samples: list[Sample] = []
    t0 = time.perf_counter()
    deadline = t0 + duration_s
    counter = iter(range(1 << 62))
    stopped = until.is_set if until is not None else lambda: False
    async with _session(timeout_s, concurrency) as session:

        async def client() -> None:
            while time.perf_counter() < deadline and not stopped():
                await _send(session, url, payloads(next(counter)), t0, samples, headers)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return LoadResult(samples, time.perf_counter() - t0)


async def open_loop(
    url: str,
    payloads: Callable[[int], Payload],
    phases: list[tuple[float, float]],
    poisson: bool = True,
    seed: int = 0,
    timeout_s: float = 300.0,
    max_in_flight: int = 2000,
    headers: dict[str, str] | None = None,
    until: threading.Event | None = None,
) -> LoadResult:
    """``phases``: [(seconds, requests per second), ...] played in order, or until ``until`` is set if that
    comes first; ``headers`` go with every request."""
    samples: list[Sample] = []
    tasks: list[asyncio.Task] = []
    t0 = time.perf_counter()
    stopped = until.is_set if until is not None else lambda: False
    async with _session(timeout_s, max_in_flight) as session:
        for i, at in enumerate(arrival_times(phases, poisson, seed)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if stopped():
                break
            tasks.append(asyncio.create_task(_send(session, url, payloads(i), t0, samples, headers)))
        await asyncio.gather(*tasks)
    return LoadResult(samples, time.perf_counter() - t0)


def arrival_times(phases: list[tuple[float, float]], poisson: bool = True, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of an open-loop schedule; the same seed gives the same times,
    so systems compared side by side see identical arrivals."""
    rng = random.Random(seed)
    times: list[float] = []
    start = 0.0
    for seconds, rate in phases:
        end = start + seconds
        at = start
        while rate > 0:
            at += rng.expovariate(rate) if poisson else 1.0 / rate
            if at >= end:
                break
            times.append(at)
        start = end
    return times


def run(coro) -> LoadResult:
    return asyncio.run(coro)

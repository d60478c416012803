"""Device, stream and event helpers: one interface for CUDA and CPU.

On CUDA a lane is a ``torch.cuda.Stream`` and completion is an event; on
CPU a lane is the calling thread and every helper is a no-op, so engine
code is written once and reads the same on both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class ExecutionDevice:
    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        if self.is_cuda and not torch.cuda.is_available():
            raise RuntimeError(f"device {self.device} requested but CUDA is not available")

    @classmethod
    def from_context(cls, context: Any) -> ExecutionDevice:
        """CUDA when TorchServe assigned this worker a GPU and one is usable, else CPU."""
        gpu_id = (getattr(context, "system_properties", None) or {}).get("gpu_id")
        if gpu_id is not None and torch.cuda.is_available():
            return cls(f"cuda:{int(gpu_id)}")
        return cls("cpu")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def new_stream(self, priority: int = 0) -> torch.cuda.Stream | None:
        return torch.cuda.Stream(self.device, priority=priority) if self.is_cuda else None

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                yield

    def record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def wait(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    @staticmethod
    def synchronize(event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    def __repr__(self) -> str:
        return f"ExecutionDevice({str(self.device)!r})"

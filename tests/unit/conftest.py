"""Fixtures the unit tests of handlers share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


@pytest.fixture
def keep_handlers() -> Iterator[Callable[[Any], Any]]:
    """Call it with each handler a test initialises: every one is closed when the test ends, and
    torch's thread count is restored (initialising a handler makes its calling thread single-threaded,
    which would slow every later test in the process)."""
    made: list[Any] = []
    threads = torch.get_num_threads()

    def keep(handler: Any) -> Any:
        made.append(handler)
        return handler

    yield keep
    for handler in made:
        handler.close(timeout_s=30)
    torch.set_num_threads(threads)

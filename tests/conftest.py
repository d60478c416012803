"""Shared fixtures: CI-sized archives and a real TorchServe on loopback ports.

One TorchServe serves the whole session (starting the JVM and loading models
is the slow part on two cores); each test registers what it needs through
``served(...)``, which registers an archive once and reuses it after.  The
server is always stopped, and a failing test that used it gets the tail of
TorchServe's logs attached to its report.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

from archiver.build import build_archive
from archiver.options import ServingOptions
from model_store.catalog import ModelSpec, get_spec, load_catalog
from serving_harness.torchserve import TorchServeProcess

# Property tests draw the same examples on every run, so that a commit's test
# result does not depend on the draw (a new counterexample once turned CI red
# on a commit that had passed); HYPOTHESIS_PROFILE=explore draws afresh, and
# what it finds becomes an @example.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

CI_MODES = ("eager", "script", "compile")
# The Ebird archive the serving tests use: small enough for 2 cores, two CPU
# lanes so batches overlap, a pool small enough that a burst fills it, and a
# fixed lane cap (not one measured on the machine) so a burst forms batches
# of several sizes on every machine.
EBIRD_TEST_SETTINGS = {
    "worker_batches": [1, 1, 2, 4, 8],
    "max_inflight": 16,
    "pool_slots": 16,
    "cpu_lanes": 2,
    "cpu_batch_cap": 8,
}
# The DVABatch archive: ResNet-50 in two stages (one lane each on 2 cores),
# batches of up to 4, stretchable for 200 ms so a burst exercises stretch.
# Eager stages: tracing them at start-up costs each worker seconds that only
# the test of the traces inside TorchServe needs (it turns them back on).
DVABATCH_TEST_SETTINGS = {
    "segments": 2,
    "max_batch": 4,
    "max_inflight": 16,
    "t_comp_wait_ms": 200.0,
    "cpu_traces": False,
}
HANDLER_OPTIONS = {
    "packrat": ServingOptions(),
    "ebird": ServingOptions(handler="ebird", handler_settings=tuple(sorted(EBIRD_TEST_SETTINGS.items()))),
    "dvabatch": ServingOptions(handler="dvabatch", handler_settings=tuple(sorted(DVABATCH_TEST_SETTINGS.items()))),
}


def ci_specs() -> list[ModelSpec]:
    return [spec.with_mode(mode) for spec in load_catalog().values() if spec.ci for mode in CI_MODES]


@pytest.fixture(scope="session")
def model_store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh model store; archives are built into it on first use."""
    return tmp_path_factory.mktemp("model_store")


@pytest.fixture(scope="session")
def archive(model_store_dir: Path):
    """``archive(name, mode, handler) -> Path``: builds the archive once per session."""

    def build(name: str, mode: str = "eager", handler: str = "packrat") -> Path:
        return build_archive(get_spec(name, mode), model_store_dir, HANDLER_OPTIONS[handler])

    return build


class ServedModels:
    """Registers archives on the session's TorchServe, each at most once."""

    def __init__(self, server: TorchServeProcess, archive) -> None:
        self.server = server
        self.archive = archive
        self.registered: set[str] = set()
        self._aliases = itertools.count()

    def __call__(self, name: str, mode: str = "eager", handler: str = "packrat", **register_kwargs) -> str:
        """Register ``<name>_<mode>`` (or a fresh alias when options differ); returns the model name."""
        path = self.archive(name, mode, handler)
        model_name = path.stem
        if register_kwargs:
            model_name = f"{model_name}-{next(self._aliases)}"
        if model_name not in self.registered:
            self.server.management().register(path.name, model_name=model_name, **register_kwargs)
            self.registered.add(model_name)
        return model_name

    def unregister(self, model_name: str) -> None:
        self.server.management().unregister(model_name)
        self.registered.discard(model_name)


@pytest.fixture(scope="session")
def torchserve(tmp_path_factory: pytest.TempPathFactory, model_store_dir: Path) -> Iterator[TorchServeProcess]:
    server = TorchServeProcess(tmp_path_factory.mktemp("torchserve"), model_store_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def served(torchserve: TorchServeProcess, archive) -> ServedModels:
    return ServedModels(torchserve, archive)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    report.test_kind = kind_of_test(item)
    if report.failed and "torchserve" in getattr(item, "fixturenames", ()):
        server = item.funcargs.get("torchserve") if hasattr(item, "funcargs") else None
        if server is not None:
            report.sections.append(("TorchServe logs", server.log_tail(60)))
    return report


def kind_of_test(item: pytest.Item) -> str:
    """``unit``, ``unit-slow``, ``serving`` or ``gpu``: the folder, and for a unit test whether it is marked
    ``slow`` (it compiles, trains or starts processes; ``make test-fast`` leaves it out)."""
    folder = Path(str(item.path)).parent.name
    if folder == "unit" and item.get_closest_marker("slow") is not None:
        return "unit-slow"
    return folder if folder in ("unit", "serving", "gpu") else "other"


_TIME_BY_KIND: dict[str, list[float]] = {}  # kind → [seconds, tests]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    kind = getattr(report, "test_kind", None)
    if kind is not None:
        totals = _TIME_BY_KIND.setdefault(kind, [0.0, 0])
        totals[0] += report.duration
        totals[1] += report.when == "call"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Seconds per kind of test, setup and teardown included: the budgets in docs/testing.md are per kind."""
    if not _TIME_BY_KIND:
        return
    terminalreporter.write_sep("-", "time per kind of test")
    for kind, (seconds, tests) in sorted(_TIME_BY_KIND.items()):
        terminalreporter.write_line(f"{kind:<10} {seconds:8.1f} s over {tests} tests")


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

"""A worker's start-up heap is frozen out of garbage collection, and what serving makes is still collected."""

from __future__ import annotations

import gc
import weakref

import pytest

from archiver.options import ServingOptions
from bench.direct import load_context, model_dir_for
from handlers.plain_handler import PlainModelHandler
from handlers.runtime.heap import freeze_startup_heap
from model_store.catalog import get_spec


class _Node:
    """A container object the collector tracks, for making cycles."""


@pytest.fixture
def thawed():
    """Each test starts and ends with nothing frozen (the test process is not a worker)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freezing_exempts_what_lives_now_and_still_collects_cycles_made_later(thawed):
    startup = _Node()
    startup.me = startup  # a cycle alive at start-up: frozen with the rest
    frozen = freeze_startup_heap()
    # The interpreter's and the test run's own objects.  A frozen object that dies later (a temporary another
    # thread held) leaves the permanent generation, so the count can only fall after the freeze, never rise.
    assert 1000 < gc.get_freeze_count() <= frozen
    assert startup not in gc.get_objects()  # frozen objects are in no generation a collection walks
    later = _Node()
    later.me = later  # garbage made while serving: a cycle only the collector can free
    gone = weakref.ref(later)
    del later
    gc.collect()
    assert gone() is None


def test_a_process_freezes_once_so_later_handlers_garbage_stays_collectable(thawed):
    first = freeze_startup_heap()
    later = _Node()
    later.me = later  # what a second handler in the same process (a test, a benchmark) would leave behind
    gone = weakref.ref(later)
    assert freeze_startup_heap() <= first  # no second freeze (frozen objects may die since, none are added)
    del later
    gc.collect()
    assert gone() is None


def test_startup_garbage_is_collected_before_the_freeze_not_kept(thawed):
    dead = _Node()
    dead.me = dead
    gone = weakref.ref(dead)
    del dead  # garbage from start-up (a checkpoint's load makes some), unreachable before the freeze
    freeze_startup_heap()
    assert gone() is None


def test_a_handler_freezes_its_model_once_initialised(thawed, tmp_path):
    spec = get_spec("bert-tiny1", "eager")
    ctx = load_context(spec, model_dir_for(spec, tmp_path / "model"), ServingOptions(batch_size=2))
    handler = PlainModelHandler()
    assert gc.get_freeze_count() == 0
    handler.initialize(ctx)
    assert gc.get_freeze_count() > 0
    tracked = set(map(id, gc.get_objects()))
    assert id(handler.model) not in tracked  # the model's modules are never walked again
    assert not any(id(module) in tracked for module in handler.model.modules())

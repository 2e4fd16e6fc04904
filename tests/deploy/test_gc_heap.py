"""The role processes' collector set-up: start-up heap frozen, first generation's threshold raised."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from deploy.gc_heap import GEN0_THRESHOLD, collect_young_if_due, freeze_heap, freeze_startup_heap, thaw_heap


class _Node:
    peer: object = None


@pytest.fixture
def restored_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_gc")
def test_freeze_startup_heap_freezes_and_raises_the_first_threshold() -> None:
    gc.unfreeze()
    _, gen1, gen2 = gc.get_threshold()
    alive = [object() for _ in range(10)]  # noqa: F841 - start-up objects that survive
    freeze_startup_heap()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (GEN0_THRESHOLD, gen1, gen2)
    assert GEN0_THRESHOLD > 700  # Python's default, which collected ~4 times per front step at 512 streams


@pytest.mark.usefixtures("restored_gc")
def test_freeze_heap_leaves_the_thresholds_and_thaw_heap_undoes_it() -> None:
    gc.unfreeze()
    thresholds = gc.get_threshold()
    garbage = _Node()
    garbage.peer = garbage  # a cycle: collected before the freeze, not frozen
    gone = weakref.ref(garbage)
    del garbage
    freeze_heap()
    assert gone() is None
    assert gc.get_freeze_count() > 0 and gc.get_threshold() == thresholds
    thaw_heap()
    assert gc.get_freeze_count() == 0


@pytest.mark.usefixtures("restored_gc")
def test_collect_young_if_due_collects_only_past_half_the_threshold() -> None:
    gc.set_threshold(10_000, 10, 10)
    gc.collect()
    assert collect_young_if_due() is None  # just collected: nothing is due
    few: list[list[int]] = [[] for _ in range(4_000)]  # live containers (the count is net of those freed): under half
    assert collect_young_if_due() is None
    more: list[list[int]] = [[] for _ in range(2_000)]  # past half of gen 0's threshold
    before = gc.get_count()
    assert before[0] >= 5_000
    assert collect_young_if_due() == (1 if before[1] >= 10 else 0)
    assert gc.get_count()[0] < 100 and len(few) + len(more) == 6_000


@pytest.mark.usefixtures("restored_gc")
def test_collect_young_if_due_takes_gen1_when_gen0_was_collected_often_enough() -> None:
    gc.set_threshold(10_000, 10, 10)
    gc.collect()
    for _ in range(10):
        gc.collect(0)  # ten young collections: gen 1 is due, as for the automatic collector
    keep: list[list[int]] = [[] for _ in range(6_000)]
    assert gc.get_count()[1] >= 10
    assert collect_young_if_due() == 1
    assert gc.get_count()[1] == 0 and len(keep) == 6_000

"""The role processes' collector set-up: start-up heap frozen, first generation's threshold raised."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from deploy.gc_heap import GEN0_THRESHOLD, freeze_startup_heap


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

"""protos/heap.py: the start-up heap frozen, later garbage still collected."""

from __future__ import annotations

import gc

from protos.heap import freeze_startup_heap


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_frozen_heap_is_left_alone_and_later_cycles_are_collected():
    try:
        frozen = freeze_startup_heap()
        assert frozen > 0 and frozen == gc.get_freeze_count()
        assert len(gc.get_objects()) < frozen  # the collector now walks only what came after
        made = Cycle()
        del made
        assert gc.collect() >= 1  # the cycle made after the freeze
    finally:
        gc.unfreeze()

"""gc_paused: the collector is off inside, restored after, and young cycles are collected on request."""

import gc
import weakref

from pipelab.common.gc_pause import gc_paused


class Node:
    pass


def _cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_collector_is_off_inside_and_restored_after():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves the outer pause alone
    assert gc.isenabled()


def test_a_caller_that_disabled_the_collector_keeps_it_disabled():
    gc.disable()
    try:
        with gc_paused(collect_young=True):
            alive = _cycle()
        assert not gc.isenabled() and alive() is not None  # nothing collected behind the caller's back
    finally:
        gc.enable()
        gc.collect()


def test_young_cycles_made_inside_are_collected_after():
    with gc_paused(collect_young=True):
        alive = _cycle()
        assert alive() is not None
    assert alive() is None

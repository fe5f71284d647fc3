"""`gc_paused()`: hold Python's cyclic garbage collector during a burst of allocations.

The collector runs every few hundred allocations and, every so often, walks every object
in the process — in a kernel that imported torch, some 300,000 of them, about 25 ms.  A
simulation allocates an object per action and a figure tens of thousands, so both trigger
such walks.  Paused, they run without them; `collect_young=True` then collects only the
objects made meanwhile (a closed figure is a web of reference cycles), which is quick.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused(collect_young: bool = False):
    """Disable the cyclic collector inside the block (nesting is fine); optionally collect the young generations after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
            if collect_young:
                gc.collect(1)

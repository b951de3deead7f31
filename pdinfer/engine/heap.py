"""Python's cyclic garbage collector against the engine loop.

A full collection scans every long-lived object. After start-up that is the imported libraries
and the model, hundreds of thousands of objects, so a full collection is a pause a run notices,
and on a GPU every such pause is a gap in the device's work
(docs/performance.md#measurements-behind-design-choices). The objects that exist once an engine
is built live as long as it does, so the loop leaves them out of collections (``gc.freeze``), as
vLLM's and SGLang's engine processes do.

The loop also raises the young generation's threshold (``LOOP_GC_THRESHOLD``). A decode step
makes thousands of short-lived containers (sample specs, deltas, each request's cumulative
output with a copy of its token ids) that reference counting frees by the end of the step; at
the default threshold of 700 the collector still ran several times a step and walked the
live ones, long token lists included: at large batches a good share of the host's work a step
(``python benchmarks/host_step.py``). Cycles are still collected, later.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Net new containers between two young-generation collections inside the engine loop.
LOOP_GC_THRESHOLD = 50_000


def _raise_threshold() -> tuple[int, int, int]:
    previous = gc.get_threshold()
    gc.set_threshold(max(previous[0], LOOP_GC_THRESHOLD), previous[1], previous[2])
    return previous


def freeze_startup_heap() -> None:
    """For a process that hosts one engine until it exits (an engine core, a DP rank): what
    exists now is never scanned again, and young objects are collected less often. Garbage
    already made is collected first."""
    gc.collect()
    gc.freeze()
    _raise_threshold()


@contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """For a loop inside a process that outlives it (``LLM.generate``): the objects that exist
    on entry are left out of collections until exit, then put back, so nothing is kept alive
    for good, and the young generation's threshold is raised until exit. Objects made inside
    are collected as usual, less often."""
    gc.freeze()
    previous = _raise_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()

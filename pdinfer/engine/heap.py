"""Python's cyclic garbage collector against the engine loop.

A full collection scans every long-lived object. After start-up that is the imported libraries
and the model, about 345,000 objects with the default model, and one full collection took about
170 ms on the 2-core Xeon; a 3.4 s offline run of 256 sequences met two of them (10 % of its
wall time), and on a GPU every such pause is a gap in the device's work. The objects that exist
once an engine is built live as long as it does, so the loop leaves them out of collections
(``gc.freeze``), as vLLM's and SGLang's engine processes do.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup_heap() -> None:
    """For a process that hosts one engine until it exits (an engine core, a DP rank): what
    exists now is never scanned again. Garbage already made is collected first."""
    gc.collect()
    gc.freeze()


@contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """For a loop inside a process that outlives it (``LLM.generate``): the objects that exist
    on entry are left out of collections until exit, then put back, so nothing is kept alive
    for good. Objects made inside are collected as usual."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

"""A request as the DP front tracks it, and the sinks its outputs go to."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdinfer.engine.output_tracker import OutputTracker
from pdinfer.outputs import Resume


@dataclass
class TrackedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields, seed resolved (a retry samples the same)
    sink: Callable[[Any], None]  # takes a RequestDelta, a RequestOutput or an exception; never blocks
    # None: the sink takes the engine's deltas as they come (a ``RequestStream`` detokenizes);
    # else the front detokenizes and the sink takes cumulative ``RequestOutput``s
    tracker: OutputTracker | None
    final_only: bool  # deliver only the final output (so the request can be retried to the end)
    dp_rank: int | None  # placement hint
    arrival_s: float
    reservation: dict[str, Any] | None = None  # a PE's request: the CE's reservation, as fields
    resume: Resume | None = None  # a migrated request: the output it continues
    # called once with the engine's answer to the add (None, a reservation's fields, or an
    # exception); None: nobody waits for it (a refusal then ends the request like an error)
    on_answer: Callable[[Any], None] | None = None
    rank: int | None = None  # where it runs now; None while it waits at the front
    refused_ranks: set[int] = field(default_factory=set)  # ranks that had no room for it
    num_output_tokens: int = 0
    num_delivered: int = 0  # items handed to the consumer: retried only while this is 0
    num_attempts: int = 0
    first_token_s: float | None = None

    def restart(self) -> None:
        """Back to the front's queue, as if never sent (nothing reached the consumer)."""
        self.rank = None
        self.refused_ranks = set()
        self.num_output_tokens = 0
        self.first_token_s = None
        if self.tracker is not None:
            t = self.tracker
            self.tracker = OutputTracker(
                t.request_id, t.prompt, t.prompt_token_ids, t.params, t.detokenizer, arrival_time=t.arrival_time
            )


class AsyncSink:
    """Hands items to an asyncio queue from the front's I/O thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, items: asyncio.Queue):
        self.loop, self.items = loop, items

    def __call__(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.items.put_nowait, item)  # RuntimeError: loop closed


class QueueSink:
    """Hands items to a thread-safe queue (the synchronous client)."""

    def __init__(self, items: queue.Queue):
        self.items = items

    def __call__(self, item: Any) -> None:
        self.items.put(item)

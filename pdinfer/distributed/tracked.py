"""A request as the DP front tracks it, and the sinks its outputs go to."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdinfer.distributed.messages import OutputDecoder
from pdinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class TrackedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields, seed resolved (a retry samples the same)
    sink: Callable[[Any], None]  # takes a RequestOutput or an exception; never blocks
    final_only: bool  # deliver only the final output (so the request can be retried to the end)
    dp_rank: int | None  # placement hint
    arrival_s: float
    rank: int | None = None  # where it runs now; None while it waits at the front
    decoder: OutputDecoder = field(default_factory=OutputDecoder)
    num_delivered: int = 0  # outputs handed to the consumer: retried only while this is 0
    num_attempts: int = 0
    first_token_s: float | None = None

    def restart(self) -> None:
        """Back to the front's queue, as if never sent (nothing reached the consumer)."""
        self.rank = None
        self.decoder = OutputDecoder()
        self.first_token_s = None

    def output(self, finished: bool, error: str | None, num_cached_tokens: int, now_s: float) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=self.decoder.snapshot(),
            finished=finished,
            error=error,
            metrics=RequestMetrics(
                arrival_time=self.arrival_s,
                first_token_time=self.first_token_s,
                finished_time=now_s if finished else None,
                num_cached_tokens=num_cached_tokens,
            ),
            extra={"dp_rank": self.rank},
        )

    def error_output(self, error: str, now_s: float) -> RequestOutput:
        """The final output of a request the group could not finish: what it had, every
        unfinished choice ending with finish_reason "error"."""
        out = self.output(True, error, 0, now_s)
        have = {c.index for c in out.outputs}
        out.outputs += [CompletionOutput(i, "", []) for i in range(self.params.get("n", 1)) if i not in have]
        for c in out.outputs:
            if c.finish_reason is None:
                c.finish_reason = "error"
        out.outputs.sort(key=lambda c: c.index)
        return out


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

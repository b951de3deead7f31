"""``EngineClient``: how serving code drives an engine, wherever its step loop runs.

One interface, three transports:
- ``InProcessEngineClient`` (``inproc_client``): the engine stepped on a thread of this process
  (unit tests, embedding);
- ``MPEngineClient`` (``mp_client``): an engine core in a process of its own (``pdinfer serve``,
  the PE and CE servers), over ZeroMQ;
- ``DPFront`` (``distributed/dp_front``): the ranks of a data-parallel group.
Each delivers the engine's per-step ``RequestDelta``s to the request's ``RequestStream`` on the
asyncio loop; the stream's ``OutputTracker`` detokenizes there, off the engine loop, and a stop
string it finds goes back to the engine as ``stop_seq``.

What a server reads: ``role``, ``limits`` (max_model_len, prompt_limit, vocab_size),
``tokenizer``, ``stats``, ``is_healthy``, ``draining``, ``error``; ``start``/``attach``/``shutdown``;
``add_request`` -> ``RequestStream``, ``abort``, ``generate``; ``drain``, ``num_unfinished``.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdinfer.engine.core_messages import EngineStats
from pdinfer.engine.detokenizer import Detokenizer
from pdinfer.engine.output_tracker import ChoiceDelta, OutputTracker
from pdinfer.engine_type import EngineType
from pdinfer.outputs import RequestDelta, RequestOutput
from pdinfer.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it failed, or it was shut down)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at its limit (``max_waiting``); the caller should retry later."""


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    prompt_limit: int
    vocab_size: int | None = None


class RequestStream:
    """One request's outputs on the client side.

    ``async for deltas in stream`` yields lists of ``ChoiceDelta``: what became visible, the
    steps that arrived meanwhile merged into one (a consumer slower than the engine sends fewer,
    larger chunks). ``output()`` is the cumulative ``RequestOutput``. Leaving it before the end
    (``close``, a cancelled ``__anext__``, garbage collection) aborts the request.
    """

    def __init__(self, client: EngineClient, tracker: OutputTracker, accepted=None):
        self.client = client
        self.tracker = tracker
        self.request_id = tracker.request_id
        self.accepted = accepted  # what the engine answered on add (a CE: its Reservation)
        self.finished = False
        self.loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def push(self, item: RequestDelta | BaseException) -> None:
        """From the client's delivery, on this stream's event loop."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[ChoiceDelta]:
        while not self.finished:
            try:
                items = [await self._queue.get()]
            except BaseException:  # cancelled: the consumer went away
                self.close()
                raise
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            for item in items:
                self._apply(item)
            shown = self.tracker.take_shown()
            if self.tracker.finished:
                self.finished = True
                self.client._forget(self)
            if shown or self.finished:
                return shown
        raise StopAsyncIteration

    def _apply(self, item: RequestDelta | BaseException) -> None:
        if isinstance(item, BaseException):
            self.finished = True
            self.client._forget(self)
            raise item
        stopped = self.tracker.apply(item)
        if stopped:
            self.client.stop_seqs([(self.request_id, index) for index in stopped])

    def output(self) -> RequestOutput:
        return self.tracker.output()

    def close(self) -> None:
        """Abort the request, if this stream is still the one its id names: a stream closed late
        (garbage collected) must not abort a newer request that took the id (a router retries a
        refused reservation under the same id)."""
        if not self.finished:
            self.finished = True
            if self.client._forget(self):
                self.client.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class EngineClient:
    """The shared half of every client: streams, trackers, delivery. Transports subclass it and
    implement ``_submit`` (send an add, return the engine's answer), ``abort``, ``stop_seqs``."""

    role: EngineType
    limits: EngineLimits
    tokenizer = None
    error: BaseException | None = None

    def __init__(self, tokenizer, max_waiting: int | None = None):
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 (or None for no limit), got {max_waiting}")
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        # Detokenizing on the event loop while a worker thread tokenizes: a Rust tokenizer must
        # not be used from two threads at once, so each gets its own copy.
        self.detokenizer = Detokenizer(copy.deepcopy(tokenizer) if tokenizer is not None else None)
        self._streams: dict[str, RequestStream] = {}
        self._num_adding = 0
        self._stats = EngineStats()
        self._draining = False  # this client sent a drain (the engine's stats say so a step later)

    # --- what the server reads -------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def is_healthy(self) -> bool:
        raise NotImplementedError

    @property
    def draining(self) -> bool:
        """Whether the engine takes no new request: this client drained it, or the engine says
        it was drained (through another client: another API server of the same core)."""
        return self._draining or self.stats.draining

    def num_waiting(self) -> int:
        """Waiting in the engine plus adds it has not answered yet."""
        return self._stats.num_waiting + self._num_adding

    def num_unfinished(self) -> int:
        """Requests that have not ended: the engine's, as of its last stats, or this client's
        open streams if more (a request the engine ended is open here until its last delta
        was read)."""
        return max(self.stats.num_requests, len(self._streams))

    def debug_ranks(self) -> list[dict]:
        """Per rank of a DP group: its blocks, requests and K/V port (``/debug/kv``); [] for
        one engine."""
        return []

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Before serving (outside the event loop)."""

    async def attach(self) -> None:
        """On the server's event loop, before the first request (background readers)."""

    def shutdown(self, timeout_s: float | None = 30.0) -> None:
        raise NotImplementedError

    async def drain(self) -> int:
        """``LLMEngine.drain()`` where the engine runs: it takes no new request from then on (an
        add raises ``NoRoomError``), and a CE ends its live requests as migrated (their streams
        end with ``migrate``). Returns how many requests it sent away; the others finish."""
        raise NotImplementedError

    # --- requests --------------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        *,
        show_token_ids: bool = False,
        apply_stops: bool = True,
        **extra,
    ) -> RequestStream:
        """Add a request and return its stream once the engine accepted it.

        ``prompt``: text or ``{"prompt"?, "prompt_token_ids"}``. A ``ValueError`` for bad input,
        ``EngineOverloadedError``, ``EngineDeadError``, or the engine's refusal (a CE's
        ``NoRoomError``, a PE's ``HandshakeError``) is raised here. ``show_token_ids`` and
        ``apply_stops``: see ``OutputTracker``.
        """
        if not self.is_healthy:
            raise EngineDeadError(self.dead_message())
        if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
            raise EngineOverloadedError(
                f"the engine has {self.num_waiting()} requests waiting (limit {self.max_waiting}); retry later"
            )
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.prompt_of(prompt)
        params.verify()
        tracker = OutputTracker(
            request_id, text, token_ids, params, self.detokenizer, show_token_ids, apply_stops=apply_stops
        )
        if extra.get("resume") is not None:  # a migrated request: its output goes on
            tracker.resume(extra["resume"])
        stream = RequestStream(self, tracker)
        self._streams[request_id] = stream  # before the add: its first delta may follow the answer
        self._num_adding += 1
        try:
            stream.accepted = await self._submit(request_id, text, token_ids, params, extra)
        except asyncio.CancelledError:
            stream.close()  # the engine may have taken it: abort it now, while the id is this stream's
            raise
        except BaseException:
            stream.finished = True  # refused: nothing to abort, now or when it is collected
            self._forget(stream)
            raise
        finally:
            self._num_adding -= 1
        return stream

    async def generate(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; stopping the iteration early aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for _ in stream:
                yield stream.output()
        finally:
            stream.close()

    def prompt_of(self, prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; token ids are checked by the engine."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, list):
            return None, list(prompt)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("a prompt is non-empty text or {'prompt_token_ids': [...]}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
        return prompt, self.tokenizer(prompt).input_ids

    # --- transport hooks -------------------------------------------------------------------------
    async def _submit(self, request_id: str, text, token_ids: list[int], params: SamplingParams, extra: dict):
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def stop_seqs(self, items: list[tuple[str, int]]) -> None:
        raise NotImplementedError

    def dead_message(self) -> str:
        return f"the engine is down: {self.error!r}" if self.error is not None else "the engine is not running"

    # --- delivery (on the event loop) ------------------------------------------------------------
    def _deliver(self, deltas: list[RequestDelta]) -> None:
        streams = self._streams
        for delta in deltas:
            stream = streams.get(delta.request_id)
            if stream is not None:
                stream.push(delta)

    def _fail_all(self, error: BaseException) -> None:
        """From any thread: every open stream ends with ``EngineDeadError``."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            try:
                stream.loop.call_soon_threadsafe(stream.push, EngineDeadError(str(error)))
            except RuntimeError:  # its event loop is closed: nobody is listening any more
                pass

    def _forget(self, stream: RequestStream) -> bool:
        """Unregister ``stream``; False if its id already names another stream (or none)."""
        if self._streams.get(stream.request_id) is not stream:
            return False
        del self._streams[stream.request_id]
        return True

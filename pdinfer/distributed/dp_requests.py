"""The DP front's requests on their ranks: where each goes, the rank's answer to its add,
its outputs, aborts, and what happens to it when a generation of the group fails.

Used by the front's I/O thread only (``dp_supervisor``), under the front's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdinfer.distributed.messages import AbortRequest, AddAnswer, AddRequest, StopSeq
from pdinfer.distributed.replica_lb import ReplicaLoadBalancer
from pdinfer.distributed.tracked import TrackedRequest
from pdinfer.engine.client import EngineDeadError
from pdinfer.engine.core import refusal_error
from pdinfer.outputs import RequestDelta, SeqDelta

if TYPE_CHECKING:
    from pdinfer.distributed.dp_front import DPFront


class RequestBook:
    def __init__(self, front: DPFront, size: int, max_attempts: int, send: Callable[[int, object], None]):
        self.front, self.size, self.max_attempts = front, size, max_attempts
        self.send = send  # (rank, message) to that rank of the current generation
        self.lb = ReplicaLoadBalancer(size)
        self.num_finished = [0] * size  # requests each rank ended (all generations)

    def dispatch(self, tracked: TrackedRequest) -> None:
        num_tokens = len(tracked.prompt_token_ids)
        rank = tracked.dp_rank
        if rank is None:
            rank = self.lb.choose(num_tokens, exclude=tracked.refused_ranks)
        self.lb.assign(tracked.request_id, rank, num_tokens)
        tracked.rank = rank
        tracked.num_attempts += 1
        prompt, token_ids = tracked.prompt, tracked.prompt_token_ids
        self.send(
            rank, AddRequest(tracked.request_id, prompt, token_ids, tracked.params, tracked.reservation, tracked.resume)
        )

    def on_answer(self, message: AddAnswer) -> None:
        """The rank's answer to an add. A reservation (a CE's) names this rank's K/V port, so
        a request that handed one out is never retried on another generation. A rank without
        room passes the request to the next least-loaded rank; when none has room, or for any
        other refusal, the caller gets the refusal."""
        tracked = self.front.requests.get(message.request_id)
        if tracked is None or tracked.rank != message.rank:
            return
        if message.refused is None:
            if message.answer is not None:
                tracked.num_delivered += 1
            self._answer(tracked, message.answer)
            return
        self.lb.release(tracked.request_id)
        if message.refused == "no_room" and tracked.dp_rank is None:
            tracked.refused_ranks.add(message.rank)
            if len(tracked.refused_ranks) < self.size:
                return self.dispatch(tracked)
        del self.front.requests[tracked.request_id]
        error = message.error or message.refused
        if tracked.on_answer is not None:
            return self._answer(tracked, refusal_error(message.refused, error))
        self._deliver_final(tracked, RequestDelta(tracked.request_id, [], True, error), message.rank)

    def _answer(self, tracked: TrackedRequest, value) -> None:
        answer, tracked.on_answer = tracked.on_answer, None
        if answer is not None:
            try:
                answer(value)
            except RuntimeError:  # the caller's event loop is closed
                pass

    def on_output(self, rank: int, delta: RequestDelta) -> None:
        tracked = self.front.requests.get(delta.request_id)
        if tracked is None or tracked.rank != rank:
            return
        tracked.num_output_tokens += sum(len(s.token_ids) for s in delta.seqs)
        if tracked.num_output_tokens and tracked.first_token_s is None:
            tracked.first_token_s = time.monotonic()
        if delta.finished:
            self.lb.release(delta.request_id)
            del self.front.requests[delta.request_id]
            self.num_finished[rank] += 1
        elif tracked.num_output_tokens:
            self.lb.progress(delta.request_id, tracked.num_output_tokens)
        self._deliver_final(tracked, delta, rank)

    def _deliver_final(self, tracked: TrackedRequest, delta: RequestDelta, rank: int) -> None:
        """Hand a delta to the consumer: as it is to a stream, else detokenized here."""
        if tracked.tracker is None:  # a stream: its consumer detokenizes
            self._deliver(tracked, delta)
            return
        for index in tracked.tracker.apply(delta):  # detokenized here
            self.send(rank, StopSeq(delta.request_id, index))
        if delta.finished or not tracked.final_only:
            output = tracked.tracker.output()
            output.extra["dp_rank"] = rank  # which rank ran it (tests, logs)
            self._deliver(tracked, output)

    def abort(self, request_id: str) -> None:
        tracked = self.front.requests.get(request_id)
        if tracked is None:
            return
        if tracked.rank is not None:
            self.send(tracked.rank, AbortRequest(request_id))  # its final output comes back
            return
        del self.front.requests[request_id]
        self.end(tracked, "aborted")

    def end(self, tracked: TrackedRequest, error: str, finish_reason: str = "abort") -> None:
        """The final delta of a request that ends at the front: every output still open ends."""
        self._answer(tracked, EngineDeadError(error))  # a caller still waiting for the add
        n = int(tracked.params.get("n", 1))
        delta = RequestDelta(tracked.request_id, [SeqDelta(i, [], finish_reason=finish_reason) for i in range(n)])
        delta.finished, delta.error = True, error
        if tracked.tracker is None:
            self._deliver(tracked, delta)
        else:
            tracked.tracker.apply(delta)
            self._deliver(tracked, tracked.tracker.output())

    def _deliver(self, tracked: TrackedRequest, item) -> None:
        try:
            tracked.sink(item)
        except RuntimeError:  # the consumer's event loop is closed: nobody listens any more
            if tracked.request_id in self.front.requests:
                self.abort(tracked.request_id)
            return
        tracked.num_delivered += 1

    def settle(self, reason: str) -> list[str]:
        """After a failed generation: the requests that ran on it and streamed nothing go back
        to the queue (their ids returned, oldest first); the others end with an error."""
        retry = []
        for tracked in list(self.front.requests.values()):
            if tracked.rank is None:
                continue
            if tracked.num_delivered == 0 and tracked.num_attempts < self.max_attempts:
                tracked.restart()
                retry.append(tracked)
                continue
            why = (
                "it had streamed output already, so it was not retried"
                if tracked.num_delivered
                else f"it failed on {tracked.num_attempts} attempts"
            )
            del self.front.requests[tracked.request_id]
            error = f"the DP group failed while this request ran on rank {tracked.rank} ({reason}); {why}"
            self.end(tracked, error, "error")
        retry.sort(key=lambda t: t.arrival_s)
        return [t.request_id for t in retry]

    def fail_all(self, error: BaseException) -> None:
        with self.front.lock:
            requests = list(self.front.requests.values())
            self.front.requests.clear()
        for tracked in requests:
            self._answer(tracked, EngineDeadError(str(error)))
            try:
                tracked.sink(EngineDeadError(str(error)))
            except RuntimeError:
                pass

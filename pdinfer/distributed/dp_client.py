"""``DPEngineClient``: the slice of ``LLMEngine`` that ``LLM`` drives, served by a DP front.

``LLM(data_parallel_size=N)`` with N > 1 holds one of these as its ``engine``: ``add_request``
sends to the front, ``step()`` returns the outputs that arrived since the last call (waiting
for at least one while requests are unfinished). Requests are sent final-only, so a request
whose rank dies is retried from the start on the restarted group instead of failing.
"""

from __future__ import annotations

import queue

from pdinfer.config import EngineArgs
from pdinfer.distributed.dp_front import DPFront, DPOptions
from pdinfer.distributed.tracked import QueueSink
from pdinfer.outputs import RequestOutput
from pdinfer.sampling_params import SamplingParams

_POLL_S = 0.2


class DPEngineClient:
    def __init__(self, engine_args: EngineArgs, options: DPOptions | None = None):
        self.front = DPFront(engine_args, options)
        self.tokenizer = self.front.tokenizer
        self.scheduler_config = self.front.scheduler_config
        self._items: queue.Queue = queue.Queue()
        self._unfinished: set[str] = set()
        self.front.start()
        try:
            self.front.wait_ready()
        except BaseException:
            self.front.shutdown()
            raise

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        return self.front.tokenize(prompt)

    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None) -> None:
        self.front.submit(
            request_id, prompt, sampling_params or SamplingParams(), QueueSink(self._items), final_only=True
        )
        self._unfinished.add(request_id)

    def abort_request(self, request_id: str) -> None:
        self.front.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """The outputs the ranks sent since the last call (waits for one while requests are
        unfinished); ``finished_only``: of the requests that ended only."""
        outputs: list[RequestOutput] = []
        while self._unfinished and not outputs:
            try:
                outputs.append(self._items.get(timeout=_POLL_S))
            except queue.Empty:
                continue
        while True:
            try:
                outputs.append(self._items.get_nowait())
            except queue.Empty:
                break
        for item in outputs:
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            if item.finished:
                self._unfinished.discard(item.request_id)
        return [o for o in outputs if o.finished] if finished_only else outputs

    def shutdown(self) -> None:
        self.front.shutdown()

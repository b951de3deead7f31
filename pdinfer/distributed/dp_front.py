"""``DPFront``: one engine made of a DP group of rank processes, behind one front.

Every role may be a group: NORMAL (the ranks vote on each step's type), and a PE or a CE (with
expert parallelism the ranks step together; see ``dp_rank``). Requests enter the front once; a
replica load balancer (``replica_lb``) picks a rank for each; outputs come back through the
front, streaming included. The rank's answer to an add comes back too: for a CE, the
reservation, which names that rank's own K/V port, so the PE pushes straight to the rank that
holds the blocks (a rank without room passes the request to the next one). A PE's request
carries its reservation to the rank that prefills it. The front presents ``AsyncEngine``'s
interface (``add_request`` -> ``RequestStream``, ``generate``, ``abort``, ``stats``,
``is_healthy``, ``role``, ``scheduler_config``, ``tokenizer``, ``start``, ``shutdown``), so
``build_app`` serves it unchanged; ``submit`` is the thread-level entry ``DPEngineClient``
(``LLM(data_parallel_size=N)``) uses.

Transport: one ZeroMQ ROUTER socket on the front, one DEALER per rank, msgspec JSON messages
(``messages``). Rendezvous of the ranks: a ``TCPStore`` the front hosts (``dp_group``).

Addresses. On one host nothing needs setting: the front binds 127.0.0.1 on free ports. Across
hosts, host 0 runs ``pdinfer serve --data-parallel-size N --data-parallel-size-local L
--dp-master-addr HOST0 --dp-master-port P`` (front + ranks 0..L-1; the store listens on P and
the front's socket on P+1), and every other host runs ``pdinfer serve --headless
--dp-rank-offset K --data-parallel-size-local L --dp-master-addr HOST0 --dp-master-port P``
(an agent starting ranks K..K+L-1 with the front's engine settings). The ports are not
authenticated: keep them on a trusted network.

Failures. A rank that exits (or sends nothing for ``heartbeat_timeout_s``) fails the whole
generation: the other ranks could only wait in their next collective (they would fail within the
group timeout by themselves). The front kills and reaps every rank of that generation, ends the
requests that already streamed output with a clear error (final output, finish_reason "error"),
queues the others again (at most ``max_attempts`` sends each; sampling seeds are fixed at the
front, so a retried request samples the same tokens) and starts a new generation on the same
store under a new key prefix. New requests wait at the front meanwhile. More than
``max_restarts`` restarts within ``restart_window_s`` -- or a failure before the group ever
came up -- leaves the front dead (``is_healthy`` False, every request failed).
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from pdinfer import env
from pdinfer.config import EngineArgs
from pdinfer.distributed.dp_supervisor import GroupSupervisor
from pdinfer.distributed.messages import RankStats, params_to_dict
from pdinfer.distributed.tracked import TrackedRequest
from pdinfer.engine.client import EngineClient, EngineDeadError, EngineLimits, EngineOverloadedError
from pdinfer.engine.core_messages import EngineStats
from pdinfer.engine.detokenizer import Detokenizer
from pdinfer.engine.output_tracker import OutputTracker
from pdinfer.engine.pd_common import NoRoomError
from pdinfer.outputs import Resume
from pdinfer.sampling_params import SamplingParams

logger = logging.getLogger("pdinfer")


@dataclass(frozen=True)
class DPOptions:
    master_addr: str = "127.0.0.1"  # where ranks find the front's store and socket
    master_port: int = 0  # the store's port; 0: a free one (one host only)
    front_port: int | None = None  # the front's ZeroMQ port; default master_port + 1 (or free)
    num_local_ranks: int | None = None  # ranks started on the front's host (default: all)
    backend: str = "auto"  # gloo on CPU, nccl on GPUs
    timeout_s: float = 60.0  # DP group timeout: the longest any collective waits
    startup_timeout_s: float = 600.0  # model loading included
    heartbeat_timeout_s: float | None = None  # default: timeout_s + 15
    max_restarts: int = 3
    restart_window_s: float = 600.0
    max_attempts: int = 2  # sends of a request that streamed nothing (1: never retried)
    max_idle_sleep_ms: float = 20.0

    def __post_init__(self) -> None:
        for name in ("timeout_s", "startup_timeout_s", "restart_window_s", "max_idle_sleep_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_attempts < 1 or self.max_restarts < 0:
            raise ValueError("max_attempts must be >= 1 and max_restarts >= 0")
        if not 0 <= self.master_port < 65535:
            raise ValueError(f"master_port must be a TCP port (0: pick one), got {self.master_port}")

    @property
    def heartbeat_s(self) -> float:
        return self.heartbeat_timeout_s or self.timeout_s + 15.0


class DPFront(EngineClient):
    def __init__(self, engine_args: EngineArgs, options: DPOptions | None = None, max_waiting: int | None = None):
        from pdinfer.models.loader import load_tokenizer, resolve_model
        from pdinfer.models.spec import ModelSpec

        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 (or None for no limit), got {max_waiting}")
        self.options = options or DPOptions()
        self.size = engine_args.data_parallel_size
        num_local = self.options.num_local_ranks or self.size
        if not 1 <= num_local <= self.size:
            raise ValueError(f"{num_local} local ranks do not fit a DP group of {self.size}")
        if engine_args.num_threads is None and engine_args.device in ("auto", "cpu"):
            # The ranks share this host's cores: a rank may not grab all of them.
            engine_args = dataclasses.replace(engine_args, num_threads=max(1, (os.cpu_count() or 1) // num_local))
        self.engine_args = engine_args
        self.max_waiting = max_waiting
        folder, hf_config = resolve_model(engine_args.model, env.get("PDINFER_CACHE_DIR"))
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.scheduler_config = engine_args.create_scheduler_config(self.spec.max_position_embeddings)
        source = engine_args.tokenizer if engine_args.tokenizer != engine_args.model else None
        super().__init__(load_tokenizer(folder, source), max_waiting)
        self.limits = EngineLimits(
            self.scheduler_config.max_model_len, self.scheduler_config.prompt_limit, self.spec.vocab_size
        )
        # The I/O thread detokenizes the outputs of ``submit`` (streams do it on their loop).
        self._front_detokenizer = Detokenizer(copy.deepcopy(self.tokenizer) if self.tokenizer else None)
        self._tokenizer_lock = threading.Lock()
        self.error: BaseException | None = None
        self.lock = threading.Lock()  # guards requests, commands and error
        self.requests: dict[str, TrackedRequest] = {}
        self.commands: deque[tuple[Any, ...]] = deque()
        self.ready_event = threading.Event()
        self._supervisor: GroupSupervisor | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.role = engine_args.role

    # --- what the server reads ---------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        sup = self._supervisor
        return (
            self.error is None
            and not self._stopped
            and sup is not None
            and sup.is_ready
            and self._thread is not None
            and self._thread.is_alive()
        )

    @property
    def stats(self) -> EngineStats:
        sup = self._supervisor
        ranks = sup.rank_stats() if sup is not None else []
        total = {
            name: sum(getattr(s, name) for s in ranks)
            for name in (
                "num_waiting",
                "num_running",
                "num_prompted",
                "num_requests",
                "num_free_blocks",
                "num_total_blocks",
                "num_prefix_hit_tokens",
                "num_prefix_query_tokens",
                "num_preemptions",
                "num_aborted",
                "num_migrated",
                "num_handoffs",
                "handoff_bytes",
                "handoff_seconds",
                "num_handoffs_failed",
            )
        }
        return EngineStats(**total, num_steps=max((s.num_steps for s in ranks), default=0), draining=self._draining)

    def debug_ranks(self) -> list[dict[str, Any]]:
        """Each rank's blocks, requests and K/V port (``/debug/kv``)."""
        sup = self._supervisor
        if sup is None:
            return []
        return [
            {
                "rank": i,
                "free_blocks": state.stats.num_free_blocks,
                "total_blocks": state.stats.num_total_blocks,
                "num_finished": sup.book.num_finished[i],
                "num_prefix_hit_tokens": state.stats.num_prefix_hit_tokens,
                "num_handoffs": state.stats.num_handoffs,
                "kv_address": state.kv_address,
            }
            for i, state in enumerate(list(sup.ranks))
        ]

    def rank_stats(self) -> list[RankStats]:
        """The latest report of every rank (vote timings included), for benchmarks."""
        return self._supervisor.rank_stats() if self._supervisor is not None else []

    def rank_pids(self) -> list[int]:
        return self._supervisor.rank_pids() if self._supervisor is not None else []

    @property
    def generation(self) -> int:
        return self._supervisor.generation if self._supervisor is not None else -1

    def num_waiting(self) -> int:
        """Requests that have not produced their first token yet (queued here or on a rank)."""
        with self.lock:
            return sum(1 for r in self.requests.values() if r.first_token_s is None)

    def num_unfinished(self) -> int:
        """The front tracks every request until its end (queued here or on a rank)."""
        with self.lock:
            return max(len(self.requests), len(self._streams))

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._supervisor = GroupSupervisor(self)
        self._thread = threading.Thread(target=self._supervisor.run, name="pdinfer-dp-front", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until every rank is up; raises ``EngineDeadError`` if the group failed."""
        if self._thread is None:
            raise EngineDeadError("the DP front is not started")
        if not self.ready_event.wait(timeout_s):
            raise TimeoutError(f"the DP group did not come up within {timeout_s} s")
        if self.error is not None:
            raise EngineDeadError(str(self.error))

    def shutdown(self, timeout_s: float | None = 30.0) -> None:
        atexit.unregister(self.shutdown)
        with self.lock:
            self._stopped = True
            self.commands.append(("stop",))
        if self._supervisor is not None:
            self._supervisor.wake()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # --- requests ------------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        sink: Callable[[Any], None],
        *,
        final_only: bool = False,
        dp_rank: int | None = None,
        raw: bool = False,
        reservation: dict[str, Any] | None = None,
        on_answer: Callable[[Any], None] | None = None,
        resume: Resume | None = None,
    ) -> None:
        """Add a request from any thread; its cumulative outputs (or an exception) go to
        ``sink``, called from the front's I/O thread (it must not block); ``raw``: the engine's
        ``RequestDelta``s instead, undetokenized. ``dp_rank`` pins it to one rank.
        ``reservation``: a PE's request, the CE's reservation as fields. ``on_answer``: called
        once from the I/O thread with the rank's answer to the add (None, a CE's reservation
        as fields, or the refusal as an exception); without it a refusal ends the request."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        params.verify()
        if dp_rank is not None and not 0 <= dp_rank < self.size:
            raise ValueError(f"dp_rank {dp_rank} is outside the group of {self.size}")
        text, token_ids = self.tokenize(prompt)
        values = params_to_dict(params)
        values["seed"] = params.resolved_seed()
        tracker = None if raw else OutputTracker(request_id, text, token_ids, params, self._front_detokenizer)
        if tracker is not None and resume is not None:
            tracker.resume(resume)
        tracked = TrackedRequest(
            request_id, text, token_ids, values, sink, tracker, final_only, dp_rank, time.monotonic(), reservation
        )
        tracked.on_answer, tracked.resume = on_answer, resume
        with self.lock:
            sup = self._supervisor  # start() sets it with _thread
            if self.error is not None or self._stopped or self._thread is None or sup is None:
                raise EngineDeadError(self.dead_message())
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            if self._draining:  # and so are the ranks (a restarted group's too)
                raise NoRoomError("this engine is draining: it takes no new requests")
            if self.max_waiting is not None:
                waiting = sum(1 for r in self.requests.values() if r.first_token_s is None)
                if waiting >= self.max_waiting:
                    raise EngineOverloadedError(
                        f"the engine has {waiting} requests waiting (limit {self.max_waiting}); retry later"
                    )
            self.requests[request_id] = tracked
            self.commands.append(("add", request_id))
        sup.wake()

    async def _submit(self, request_id: str, text, token_ids, params: SamplingParams, extra: dict):
        from pdinfer.engine.pd_common import Reservation

        stream = self._streams[request_id]
        loop = stream.loop
        answer = loop.create_future()

        def sink(item) -> None:
            loop.call_soon_threadsafe(stream.push, item)  # RuntimeError: the loop is closed

        def on_answer(value) -> None:
            loop.call_soon_threadsafe(_settle, answer, value)

        dp_rank = extra.pop("dp_rank", None)
        reservation, resume = extra.pop("reservation", None), extra.pop("resume", None)
        if extra:
            raise ValueError(f"unknown request options: {sorted(extra)}")
        fields = None if reservation is None else msgspec.to_builtins(reservation)
        prompt = {"prompt": text, "prompt_token_ids": token_ids}
        self.submit(
            request_id,
            prompt,
            params,
            sink,
            dp_rank=dp_rank,
            raw=True,
            reservation=fields,
            on_answer=on_answer,
            resume=resume,
        )
        try:
            value = await answer  # the rank's: a CE's reservation names its own K/V port
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if isinstance(value, BaseException):
            raise value
        return None if value is None else msgspec.convert(value, Reservation)

    async def drain(self) -> int:
        """Every rank drains (``GroupSupervisor._drain``); the front takes no new request."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def on_done(num_migrated: int) -> None:
            loop.call_soon_threadsafe(_settle, answer, num_migrated)

        with self.lock:
            if self.error is not None or self._stopped or self._supervisor is None:
                raise EngineDeadError(self.dead_message())
            self._draining = True
            self.commands.append(("drain", on_done))
        self._supervisor.wake()
        return await answer

    def stop_seqs(self, items: list[tuple[str, int]]) -> None:
        with self.lock:
            self.commands.extend(("stop_seq", request_id, index) for request_id, index in items)
        if self._supervisor is not None:
            self._supervisor.wake()

    def abort(self, request_id: str) -> None:
        """Thread-safe; a no-op for a request that already finished."""
        with self.lock:
            self.commands.append(("abort", request_id))
        if self._supervisor is not None:
            self._supervisor.wake()

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """What ``LLMEngine.tokenize`` accepts, checked here so a bad prompt fails at once."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
        if isinstance(prompt, list):
            return None, self._check_token_ids(prompt)
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt is text or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("the prompt is empty")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
        with self._tokenizer_lock:
            return prompt, self._check_token_ids(self.tokenizer(prompt).input_ids)

    def _check_token_ids(self, token_ids) -> list[int]:
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.spec.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return token_ids

    def dead_message(self) -> str:
        if self.error is not None:
            return f"the DP group is down: {self.error}"
        if self._thread is None:
            return "the DP front is not started"
        return "the DP front is shut down"


def _settle(answer: asyncio.Future, value) -> None:
    if answer.done():  # the caller went away
        return
    if isinstance(value, BaseException):
        answer.set_exception(value)
    else:
        answer.set_result(value)

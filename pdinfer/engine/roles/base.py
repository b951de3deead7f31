"""``Role``: what an engine does at the seed's hook points, and how it admits and ends requests.

``LLMEngine`` owns the step loop and calls DeepInfer's hooks in the seed's order; each hook
a role changes delegates to ``engine.role``. ``Role`` itself is the seed's default behaviour,
which is NORMAL's (``NormalRole`` adds nothing); ``PrefillRole`` and ``CompletionRole`` override
what their half of the P/D hand-off needs. A role sees its engine through ``EngineView``: the
parts it may use, typed, and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from pdinfer.config import CacheConfig, EngineArgs, SchedulerConfig
    from pdinfer.core.block_manager import BlockManager
    from pdinfer.core.outputs import SchedulerOutputs
    from pdinfer.core.scheduler import Scheduler
    from pdinfer.engine.kv_store_agent import KVStoreAgent
    from pdinfer.engine.output_processor import OutputProcessor
    from pdinfer.engine.pd_common import Reservation
    from pdinfer.engine.request import RequestState
    from pdinfer.engine.step_builder import StepBuilder
    from pdinfer.engine_type import EngineType
    from pdinfer.models.spec import ModelSpec
    from pdinfer.outputs import Resume
    from pdinfer.sampling_params import SamplingParams
    from pdinfer.sequence import Sequence
    from pdinfer.worker.executor import StepExecutor
    from pdinfer.worker.runner import StepRunner


class EngineView(Protocol):
    """The engine as its role sees it (``LLMEngine`` is one)."""

    @property
    def args(self) -> EngineArgs: ...
    @property
    def engine_type(self) -> EngineType: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def model_folder(self) -> str: ...
    @property
    def spec(self) -> ModelSpec: ...
    @property
    def cache_config(self) -> CacheConfig: ...
    @property
    def scheduler_config(self) -> SchedulerConfig: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def model_runner(self) -> StepRunner: ...
    @property
    def block_manager(self) -> BlockManager: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def executor(self) -> StepExecutor: ...
    @property
    def step_builder(self) -> StepBuilder: ...
    @property
    def output_processor(self) -> OutputProcessor: ...
    @property
    def kv_store(self) -> KVStoreAgent | None: ...
    @property
    def requests(self) -> dict[str, RequestState]: ...

    def add_request(
        self,
        request_id: str,
        prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        enqueue: bool = True,
        reservation: Reservation | None = None,
        resume: Resume | None = None,
    ) -> Sequence: ...

    def build_request(
        self,
        request_id: str,
        prompt,
        sampling_params: SamplingParams | None,
        arrival_time: float | None,
        enqueue: bool,
        resume: Resume | None = None,
    ) -> Sequence:
        """A request's first sequence, admitted; in ``waiting`` if ``enqueue``."""
        ...

    def unbuild_request(self, request_id: str) -> None:
        """Forget a request ``build_request`` made that the role then refused (nothing ran)."""
        ...

    def abort_request(self, request_id: str) -> None: ...

    def drop_request(self, request_id: str) -> None:
        """Abort without asking the role (what ``abort_request`` does once the role is done)."""
        ...

    def publish(self, state: RequestState) -> None:
        """Queue ``state``'s delta for the next outputs (a request changed between steps)."""
        ...


class Role:
    engine_type: ClassVar[EngineType]
    # --- what the role does: the engine asks these, never which role it is ----------------------
    pd_split: ClassVar[bool] = False  # one half of a P/D split: init_pd_split runs (PE, CE)
    decodes: ClassVar[bool] = True  # it runs decode steps (so decode CUDA graphs pay off)
    finalizes_seqs: ClassVar[bool] = True  # finished sequences go through finalize_seq
    hands_off_prompts: ClassVar[bool] = False  # send_processed_prompts ends each post_process
    first_tokens_only: ClassVar[bool] = False  # output processing records first tokens only
    ends_on_stop_strings: ClassVar[bool] = True  # a client's stop string ends an output here
    # Grammar masks may wait for the host work overlapped with the forward: not when a hook
    # reads the K/V of the step just launched (a PE's hand-off).
    defers_grammar_masks: ClassVar[bool] = True
    loads_kv_store: ClassVar[bool] = True  # prompts take stored prefixes (with prefix caching)
    saves_kv_store: ClassVar[bool] = True  # full blocks go to the KV store
    # On drain, live requests leave as migrated (their client continues them elsewhere)
    # instead of finishing here.
    migrates_on_drain: ClassVar[bool] = False
    handoff_stats: dict[str, float] | None = None  # a PE's confirmed hand-offs, cumulative

    def __init__(self, engine: EngineView):
        self.engine = engine  # built before the engine's parts: use them from the hooks on

    @property
    def kv_address(self) -> str | None:
        """Where PEs send this engine K/V (a CE's port), else None."""
        return None

    # --- the hooks -----------------------------------------------------------------------------
    def init_pd_split(self) -> None:
        pass

    def post_schedule(self, plan: SchedulerOutputs) -> None:
        pass

    def check_plan(self, plan: SchedulerOutputs) -> None:
        """Refuse a plan this role must never launch (raises)."""

    def do_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        kv_store = self.engine.kv_store
        if kv_store is not None:
            kv_store.save(scheduled, finished)

    def pe_prepare_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        kv_store = self.engine.kv_store
        if kv_store is not None:  # NORMAL finalizes after prefill steps too
            kv_store.save([], finished)

    def pe_do_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        pass

    def send_processed_prompts(self) -> None:
        pass

    # --- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt,
        sampling_params: SamplingParams | None,
        arrival_time: float | None,
        enqueue: bool,
        reservation: Reservation | None,
        resume: Resume | None = None,
    ) -> Sequence:
        if reservation is not None:
            raise ValueError("only a prefill engine takes a reservation")
        return self.engine.build_request(request_id, prompt, sampling_params, arrival_time, enqueue, resume)

    def admit(
        self,
        request_id: str,
        prompt,
        sampling_params: SamplingParams,
        reservation: Reservation | None,
        resume: Resume | None = None,
    ) -> Reservation | None:
        """A client's request: what the client is answered (a CE's reservation, else None)."""
        self.engine.add_request(request_id, prompt, sampling_params, reservation=reservation, resume=resume)
        return None

    def abort_request(self, request_id: str) -> bool:
        """The role's part of an abort; True if that ended the request (nothing else to do)."""
        return False

    def begin_step(self) -> None:
        """The first thing of every step, before the KV store's loads and ``schedule()``."""

    def poll_peers(self) -> None:
        """Take what other engines sent (K/V, acks, handshakes) between steps."""

    def waits_on_peers(self) -> bool:
        """Whether requests wait on another engine (no step work, but not finished)."""
        return False

    def shutdown(self) -> None:
        pass

"""``LLMEngine``: one class, three roles. The step loop and the hook points of the seed.

The role is a component, ``self.role`` (``engine/roles/``), built from ``EngineArgs.role``: the
hooks a role changes delegate to it, and so do admission (a CE's reservation), aborts, the
waits on other engines and shutdown. ``LLMEngine(EngineArgs(engine_type=...))`` is a complete
NORMAL engine, PE or CE.

``step_deltas()`` is the engine loop's step: it returns every request's new token ids
(``RequestDelta``) and never detokenizes; an engine core (``engine/core``) ships those to its
clients. ``step()`` is the same step with the client side in process (``OutputTracker``:
text, stop strings, cumulative ``RequestOutput``s), for ``LLM`` and for embedding.

``step()`` calls, in this order: schedule -> post_schedule -> (decode) should_copy_state /
do_copy_state -> [a PROMPT step must be a prompt_run] -> launch forward + sampling ->
pre_sampler_sync (decode: wait copy_state_event, do_save_kvcache; prefill:
pe_prepare_save_kvcache; COMPLETION/NORMAL: finalize_seq of finished) -> wait for sampling ->
post_process (prefill: pe_do_save_kvcache; PROMPT: send_processed_prompts).
With zero-overhead scheduling the post_process of step N runs after step N+1 was launched.
"""

from __future__ import annotations

import functools
import logging
import os
from array import array
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from pdinfer.config import EngineArgs, SchedulerConfig, default_kv_cache_memory_bytes
from pdinfer.core.block_manager import BlockManager
from pdinfer.core.dp import DPGroup
from pdinfer.core.outputs import SchedulerOutputs
from pdinfer.core.scheduler import Scheduler
from pdinfer.core.state_manager import StateManager
from pdinfer.engine.detokenizer import Detokenizer
from pdinfer.engine.kv_store_agent import KVStoreAgent, StoreSite
from pdinfer.engine.output_processor import OutputProcessor
from pdinfer.engine.output_tracker import OutputTracker
from pdinfer.engine.pd_common import NoRoomError, Reservation, kv_layout
from pdinfer.engine.request import RequestState, resume_seq
from pdinfer.engine.roles import Role, make_role
from pdinfer.engine.speculative import build_draft_pool, decode_graph_rows, mtp_cache_layers
from pdinfer.engine.step_builder import InFlight, StepBuilder
from pdinfer.engine.step_log import StepLog
from pdinfer.engine_type import EngineType
from pdinfer.models.loader import load_tokenizer, resolve_model
from pdinfer.models.spec import ModelSpec
from pdinfer.moe.balancer import ExpertLoadBalancer
from pdinfer.moe.sharding import expert_group_of
from pdinfer.outputs import MIGRATE_DRAIN, RequestDelta, RequestOutput, Resume
from pdinfer.sampling_params import SamplingParams
from pdinfer.sequence import Sequence, SequenceStatus
from pdinfer.worker.executor import StepExecutor
from pdinfer.worker.runner import StepRunner, make_runner

logger = logging.getLogger("pdinfer")


class LLMEngine:
    # Typed here for the roles' view of the engine (``roles.EngineView``).
    num_blocks: int
    model_runner: StepRunner
    block_manager: BlockManager
    scheduler_config: SchedulerConfig

    def __init__(self, engine_args: EngineArgs, dp_group: DPGroup | None = None):
        self.args = engine_args
        self.engine_type: EngineType = engine_args.role
        # First, before the model loads: a role's settings (``kv_transfer``) fail at once.
        self.role: Role = make_role(self)
        self.parallel_config = engine_args.create_parallel_config()  # refuses CP for COMPLETION
        self.device, self.dtype = _device_and_dtype(engine_args)
        if self.device.type == "cpu" and engine_args.num_threads:
            torch.set_num_threads(engine_args.num_threads)
        hf_config, expert_group = self._load_model(dp_group)
        self.zero_overhead = engine_args.zero_overhead_scheduling
        self.use_cuda_graph = self.device.type == "cuda" and not engine_args.enforce_eager and self.role.decodes
        self._init_cache()
        self.block_manager = BlockManager(
            self.num_blocks, self.cache_config.block_size, self.cache_config.enable_prefix_caching
        )
        # Speculative decoding: NORMAL and COMPLETION only (None on a PE or when off).
        self.draft_pool = build_draft_pool(
            engine_args, hf_config, self.model_runner, self.num_blocks, self.cache_config.block_size
        )
        self.scheduler = Scheduler(
            self.scheduler_config, self.block_manager, dp_group, self._state_manager(), self.draft_pool
        )
        self.executor = StepExecutor(self.model_runner, overlap=self.zero_overhead)
        self.eplb: ExpertLoadBalancer | None = None  # MoE with expert parallelism or replicas
        if self.model_runner.moe_layers:
            self.eplb = ExpertLoadBalancer(self.model_runner.moe_layers, self.moe_config, expert_group, self.executor)
        self.kv_store = self._open_kv_store()  # None unless EngineArgs.kv_store is set
        self.step_builder = StepBuilder()
        self.requests: dict[str, RequestState] = {}
        self.output_processor = OutputProcessor(
            self.requests,
            self.scheduler,
            self.scheduler_config.max_model_len,
            self.role.first_tokens_only,
            report=self._report,
            forget_seq=self.forget_seq,
        )
        self.num_aborted = 0  # live requests aborted (client disconnects included), cumulative
        self.num_migrated = 0  # requests that ended here to be continued elsewhere, cumulative
        self.draining = False  # ``drain()``: new requests are refused
        self.copy_state: dict[int, tuple[int, torch.Tensor]] | None = {}
        self.copy_state_event: Future | None = None
        self._inflight: InFlight | None = None
        self._grammars = None  # GrammarCompiler, built at the first structured request
        self.last_step_ran = False  # whether the last step launched device work
        self._ready_outputs: list[RequestDelta] = []
        self._trackers: dict[str, OutputTracker] | None = None  # step()'s client side, once used
        # Requests that ended with their delta still in _ready_outputs before step() was first
        # used (a handshake refused inside add_request): that first step() tracks them too.
        self._ended_untracked: dict[str, RequestState] = {}
        # Called with every plan about to be launched (``step_log.StepLog`` and the like).
        self.step_observers: list[Callable[[SchedulerOutputs], None]] = []
        if engine_args.step_log:
            self.step_observers.append(StepLog(engine_args.step_log))
        logger.info(
            "%s engine ready: %s, %d KV blocks of %d tokens, zero-overhead scheduling %s",
            self.name,
            self.spec.architecture,
            self.num_blocks,
            self.cache_config.block_size,
            "on" if self.zero_overhead else "off",
        )

    def _load_model(self, dp_group: DPGroup | None):
        """The model's configs, tokenizer and runner; returns the HF config and the EP group."""
        engine_args = self.args
        self.model_folder, hf_config = resolve_model(engine_args.model, engine_args.cache_dir)
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.scheduler_config = engine_args.create_scheduler_config(self.spec.max_position_embeddings)
        self.cache_config = engine_args.create_cache_config()
        self.moe_config = engine_args.create_moe_config(self.scheduler_config)  # EP, EPLB, workspace
        expert_group = expert_group_of(dp_group, self.moe_config, self.device)  # None without EP
        tokenizer_source = engine_args.tokenizer if engine_args.tokenizer != engine_args.model else None
        self.tokenizer = load_tokenizer(self.model_folder, tokenizer_source)
        self.model_runner = make_runner(
            self.spec,
            self.model_folder,
            engine_args.load_format,
            self.dtype,
            self.device,
            engine_args.runner_options,
            engine_args.seed,
            self.moe_config,
            expert_group,
        )
        return hf_config, expert_group

    @property
    def name(self) -> str:
        return f"{self.engine_type.name}_{self.device.type}"

    def _init_cache(self) -> None:
        cc, sc = self.cache_config, self.scheduler_config
        if cc.num_blocks is not None:
            self.num_blocks = cc.num_blocks
        else:
            memory_bytes = cc.kv_cache_memory_bytes
            # The role's largest step: a CE's is a decode step of every sequence with its draft
            # tokens (so it gets more blocks than a PE with the same memory), others' a prefill.
            if self.engine_type.sizes_for_decode:
                tokens = rows = sc.max_num_seqs * (1 + self.args.num_draft_tokens)
            else:
                tokens, rows = sc.max_num_batched_tokens, sc.max_num_seqs
            self.num_blocks = self.model_runner.profile_num_blocks(
                memory_bytes if memory_bytes is not None else default_kv_cache_memory_bytes(),
                cc.block_size,
                tokens,
                rows,
                self.engine_type.sizes_for_decode,
                gpu_memory_utilization=cc.gpu_memory_utilization,
                graphs=self.use_cuda_graph,
                extra_layers=mtp_cache_layers(self.args),
            )
        self.model_runner.init_cache(self.num_blocks, cc.block_size)
        if self.role.pd_split:
            # After the KV cache exists (a connector may register it), before graph capture.
            self.init_pd_split()
        if self.use_cuda_graph:  # the warm-up step: capture decode graphs over the real cache
            self.model_runner.capture_cuda_graphs(decode_graph_rows(self.args), sc.max_model_len)

    def _open_kv_store(self) -> KVStoreAgent | None:
        site = StoreSite(
            self.block_manager,
            self.model_runner.require_cache(),
            self.scheduler,
            self.executor,
            self.role.loads_kv_store,
            self.role.saves_kv_store,
        )
        return KVStoreAgent.create(self.args, lambda: kv_layout(self), site)

    def _state_manager(self) -> StateManager | None:
        """State slots only for models with per-sequence state (none of the Llama family)."""
        shape = getattr(self.model_runner.model, "state_shape", None)
        if not shape:
            return None
        num_slots = 2 * self.scheduler_config.max_num_seqs
        self.model_runner.require_cache().init_states(num_slots, tuple(shape))
        return StateManager(num_slots)

    # --- the hooks (DeepInfer's names; the role's where it differs) -------------------------------
    def init_pd_split(self) -> None:
        self.role.init_pd_split()

    def post_schedule(self, outputs: SchedulerOutputs) -> None:
        self.role.post_schedule(outputs)

    def should_copy_state(self, seq: Sequence) -> bool:
        return False

    def do_copy_state(self, seqs: list[Sequence]) -> None:
        """Snapshot the given sequences' K/V (their state) into ``copy_state``; launch only.

        The copy runs in step order; ``pre_sampler_sync`` waits for ``copy_state_event``
        before ``do_save_kvcache`` reads the snapshot.
        """
        copy_state = self.copy_state
        if copy_state is None:
            return
        cache = self.model_runner.require_cache()
        jobs = [(seq.seq_id, seq.num_computed_tokens - 1, list(seq.block_table)) for seq in seqs]

        def copy() -> None:
            for seq_id, num_tokens, blocks in jobs:
                copy_state[seq_id] = (num_tokens, cache.read_blocks(blocks))

        self.copy_state_event = self.executor.submit_call(copy)

    def do_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        self.role.do_save_kvcache(scheduled, finished)  # COMPLETION/NORMAL: the KV store's saves

    def pe_prepare_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        self.role.pe_prepare_save_kvcache(scheduled, finished)  # PROMPT: stage the hand-off's K/V

    def pe_do_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        self.role.pe_do_save_kvcache(scheduled, finished)  # PROMPT: push K/V + first token

    def send_processed_prompts(self) -> None:
        self.role.send_processed_prompts()

    def finalize_seq(self, seq: Sequence) -> None:
        self.scheduler.free_seq(seq)
        self.forget_seq(seq)

    def forget_seq(self, seq: Sequence) -> None:
        """Drop the step builder's and the state copy's entries of an ended sequence (the
        scheduler freed its blocks: ``finalize_seq``, or a preemption that ended it)."""
        self.step_builder.forget(seq)
        if self.copy_state is not None:
            self.copy_state.pop(seq.seq_id, None)

    # --- requests ----------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        enqueue: bool = True,
        reservation: Reservation | None = None,
        resume: Resume | None = None,
    ) -> Sequence:
        """Create a request's first sequence; ``enqueue=False`` leaves it out of the scheduler
        (a CE builds it, reserves blocks and enqueues it once its K/V has arrived). A PE takes
        only requests with the ``reservation`` a CE made for them. ``resume``: continue an
        output another engine started (request migration; see ``outputs.Resume``)."""
        return self.role.add_request(request_id, prompt, sampling_params, arrival_time, enqueue, reservation, resume)

    def build_request(
        self,
        request_id: str,
        prompt,
        sampling_params: SamplingParams | None,
        arrival_time: float | None,
        enqueue: bool,
        resume: Resume | None = None,
    ) -> Sequence:
        """Validate, build and admit a request's first sequence (every role's first part)."""
        params = sampling_params or SamplingParams()
        params.verify()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        if params.logit_bias and max(params.logit_bias) >= self.spec.vocab_size:
            raise ValueError(f"logit_bias keys must be token ids below the vocabulary size {self.spec.vocab_size}")
        grammar = self._grammar_compiler().grammar(params.structured_outputs) if params.structured_outputs else None
        room = self.scheduler_config.max_model_len - len(token_ids)
        max_tokens = max(1, min(params.max_tokens or room, room))
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            seed=params.resolved_seed(),
            max_tokens=max_tokens,
            eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
        )
        seq.grammar = grammar
        if resume is not None:
            # an output of n > 1 may have had no token yet when its request left
            resume_seq(seq, resume, self._check_token_ids(resume.token_ids) if resume.token_ids else [])
        self.scheduler.admit(seq)  # refuses what the KV cache can never hold (before anything is kept)
        state = RequestState(request_id, text, token_ids, params, [seq])
        if arrival_time is not None:
            state.arrival_time = arrival_time
        self.requests[request_id] = state
        self._track(state)
        if enqueue:
            self.scheduler.add_sequence(seq)
        return seq

    def unbuild_request(self, request_id: str) -> None:
        """Forget a request ``build_request`` made that the role then refused (nothing ran)."""
        self.requests.pop(request_id, None)
        if self._trackers is not None:
            self._trackers.pop(request_id, None)

    def admit(
        self,
        request_id: str,
        prompt,
        sampling_params: SamplingParams,
        reservation: Reservation | None = None,
        resume: Resume | None = None,
    ) -> Reservation | None:
        """A client's request (an engine core's ``AddRequest``); returns what the client is
        answered: a CE's reservation (``CompletionRole.reserve``), else None. A PE takes the
        ``reservation`` a CE made. A draining engine refuses it (``NoRoomError``)."""
        if self.draining:
            raise NoRoomError("this engine is draining: it takes no new requests")
        return self.role.admit(request_id, prompt, sampling_params, reservation, resume)

    def drain(self) -> int:
        """``POST /admin/drain``: take no new request. A role that migrates (a CE) ends every
        live request as migrated (``RequestDelta.migrate``), so that its client (the router)
        continues it on another engine from the tokens it has; other roles finish what they
        hold (a PE's prefills are short, and a NORMAL engine's client cannot resume). Returns
        how many requests were sent away."""
        self.draining = True
        if not self.role.migrates_on_drain:
            return 0
        live = list(self.requests.values())
        if self.kv_store is not None:  # the PE that recomputes them loads these instead
            leaving = [s for state in live for s in state.seqs if s.block_table and not s.is_finished]
            self.kv_store.save_leaving([(seq, seq.block_table) for seq in leaving])
        for state in live:
            state.migrate = MIGRATE_DRAIN
            self.abort_request(state.request_id)
        return len(live)

    def fork_request(
        self,
        source: Sequence,
        blocks: list[int] | None = None,
        request_id: str | None = None,
        replace_last_token_id: int | None = None,
    ) -> Sequence:
        """Continue ``source``'s computed prefix as a request of this engine (``fork_seq``).

        ``blocks`` are this engine's blocks already holding the prefix K/V (a hand-off from
        another engine); ``None`` shares ``source``'s blocks (a fork within this engine).
        """
        request_id = request_id or source.request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        fork = self.scheduler.fork_seq(source, blocks, replace_last_token_id=replace_last_token_id)
        fork.request_id = request_id
        state = RequestState(request_id, None, list(source.prompt_token_ids), source.sampling_params, [fork])
        state.expected_seqs = 1
        self.requests[request_id] = state
        self._track(state)
        return fork

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            return prompt.get("prompt"), self._check_token_ids(_no_bools(prompt["prompt_token_ids"]))
        if isinstance(prompt, list):
            return None, self._check_token_ids(_no_bools(prompt))
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt is text or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("the prompt is empty")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
        return prompt, self._check_token_ids(self.tokenizer(prompt).input_ids)

    def _check_token_ids(self, token_ids) -> list[int]:
        vocab = self.spec.vocab_size
        message = f"prompt token ids must be integers in [0, {vocab})"
        if isinstance(token_ids, (str, bytes, dict)):
            raise ValueError(message)
        try:  # a C loop: 64-bit integers only (a float, string or None raises), then the range
            ids = array("q", token_ids)
        except (TypeError, OverflowError, ValueError) as e:
            raise ValueError(message) from e
        if not ids:
            raise ValueError("the prompt is empty")
        values = np.frombuffer(ids, dtype=np.int64)  # the range without an int object per token
        if values.min() < 0 or values.max() >= vocab:
            raise ValueError(message)
        return ids.tolist()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def abort_request(self, request_id: str) -> None:
        if not self.role.abort_request(request_id):  # a CE's reservation ends there
            self.drop_request(request_id)

    def drop_request(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is None:
            return
        if state.migrate is None:  # a request sent elsewhere is counted as migrated, not aborted
            self.num_aborted += 1
        self.scheduler.abort(request_id)
        for seq in state.seqs:
            if not seq.is_finished:  # not in the scheduler (e.g. a CE sequence not yet enqueued)
                self.output_processor.abort(seq)
        state.expected_seqs = len(state.seqs)  # n > 1: no forks will come (the request ends now)
        state.error = state.error or "aborted"
        self.publish(state)

    def publish(self, state: RequestState) -> None:
        delta = self._report(state)
        if delta.finished and self._trackers is None:
            self._ended_untracked[state.request_id] = state
        self._ready_outputs.append(delta)

    def _take_ready_outputs(self) -> list[RequestDelta]:
        outputs, self._ready_outputs = self._ready_outputs, []
        self._ended_untracked.clear()  # their deltas leave now
        return outputs

    def stop_seq(self, request_id: str, index: int) -> None:
        """End output ``index`` of a request: a stop string completed it (the client side found
        it). A no-op for a request or output that already ended, and on a role whose outputs
        end elsewhere (a PE's end with its hand-off).

        The output's end needs no delta (the client knows), but the request's end gets one,
        finished and empty: every layer between the engine and the client (an engine core's
        owners, a DP front's load balancer and its final-only outputs) forgets a request only
        on its finished delta."""
        state = self.requests.get(request_id)
        if state is None or not self.role.ends_on_stop_strings:
            return
        for seq in state.seqs:
            if seq.index == index and not seq.is_finished:
                seq.finish(SequenceStatus.FINISHED_STOPPED)
                self.scheduler.finish_seq(seq)
                seq.reported_finished = True  # the client knows this output ended
                if state.finished:
                    self.publish(state)

    def has_unfinished_requests(self) -> bool:
        return self.has_step_work() or self.role.waits_on_peers()

    def has_step_work(self) -> bool:
        """Whether a step would run something. A P/D role may have requests that only wait for
        another engine (a CE's reservations, a PE's acks): ``poll_peers`` serves those."""
        # An empty step in flight (a DP rank's companion step) carries nothing to finish.
        inflight = self._inflight is not None and not self._inflight.plan.is_empty
        return bool(self.scheduler.has_unfinished_seqs() or inflight or self._ready_outputs)

    def poll_peers(self) -> list[RequestDelta]:
        """Between steps, take what other engines sent (a P/D role's K/V arrivals, acks and
        handshakes) without launching a step; returns the outputs that produced. A DP rank
        calls it while no rank of its group has a step to run."""
        self.role.poll_peers()
        return self._take_ready_outputs()

    def get_num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    # --- the step ----------------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One step, with the client side in process: the cumulative output (text included)
        of every request the step touched. ``finished_only``: of the requests that ended only
        (``LLM.generate`` reads no other, and each output copies its request's tokens)."""
        if self._trackers is None:  # first use: track what is already here
            self._trackers = {}
            for state in [*self.requests.values(), *self._ended_untracked.values()]:
                self._track(state)
        outputs = []
        for delta in self.step_deltas():
            tracker = self._trackers.get(delta.request_id)
            if tracker is None:
                continue
            for index in tracker.apply(delta):
                self.stop_seq(delta.request_id, index)
            if tracker.finished:
                del self._trackers[delta.request_id]
            elif finished_only:
                continue
            outputs.append(tracker.output())
        return outputs

    def _track(self, state: RequestState) -> None:
        if self._trackers is not None and state.request_id not in self._trackers:
            tracker = self._trackers[state.request_id] = OutputTracker(
                state.request_id,
                state.prompt,
                state.prompt_token_ids,
                state.sampling_params,
                self.detokenizer,
                arrival_time=state.arrival_time,
            )
            first = state.seqs[0] if state.seqs else None
            if first is not None and first.num_resumed_tokens:  # outputs hold what it came with
                resumed = first.output_token_ids[: first.num_resumed_tokens]
                tracker.resume(Resume(resumed, first.index, num_shown_chars=1 << 62))

    @functools.cached_property
    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.tokenizer)

    def _grammar_compiler(self):
        if self._grammars is None:
            from pdinfer.engine.structured import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size)
        return self._grammars

    def step_deltas(self) -> list[RequestDelta]:
        """One step of the engine loop: every request's new token ids, no text."""
        self.role.begin_step()  # a CE takes the K/V that arrived
        if self.kv_store is not None:
            self.kv_store.load_waiting()  # stored prefixes become prefix-cache hits
        drained: list[RequestDelta] = []
        if self._inflight is not None and self._drafts_wait_for(self._inflight):
            # Drafts are looked up in known tokens, and a step that verified drafts decides
            # where the next one starts: finish the step in flight first (no overlap).
            drained = self._post_process_step(self._inflight)
            self._inflight = None
        plan = self.scheduler.schedule()
        self.post_schedule(plan)
        previous = self._inflight
        constrained = previous is not None and any(seq.grammar is not None for seq in plan.scheduled_seqs)
        if previous is not None and constrained and not self._can_defer_masks():
            # A grammar's next mask needs the token in flight: finish that step first.
            drained += self._post_process_step(previous)
            self._inflight = previous = None
        if not plan.prompt_run:
            to_copy = [seq for seq in plan.scheduled_seqs if self.should_copy_state(seq)]
            if to_copy:
                self.do_copy_state(to_copy)
        self.role.check_plan(plan)  # a PROMPT step must be a prompt_run
        for observe in self.step_observers:
            observe(plan)
        inflight = self._launch(plan, previous if constrained else None)
        self.last_step_ran = inflight is not None
        if inflight is not None and self.eplb is not None:
            self.eplb.on_step(plan.prompt_run)  # may rearrange the experts after this forward
        self.pre_sampler_sync(plan)
        outputs = self._take_ready_outputs() + drained
        outputs += self.output_processor.scheduler_outputs(plan)
        if not self.zero_overhead:
            return outputs + (self._post_process_step(inflight) if inflight is not None else [])
        self._inflight = inflight
        if inflight is not None and inflight.inp.masks_later is not None:
            host_work = inflight.inp.masks_later.take_deltas  # also computes the new step's masks
        elif previous is not None:
            host_work = lambda: self._post_process_step(previous)  # noqa: E731
        else:
            host_work = list
        return outputs + self.executor.overlap_with(inflight.future if inflight is not None else None, host_work)

    def _drafts_wait_for(self, inflight: InFlight) -> bool:
        """Whether the next schedule must wait for the step in flight: it verifies drafts, or
        one of its sequences may draft next (its drafts need its newest token)."""
        pool = self.draft_pool
        if pool is None:
            return False
        if not pool.drafts_at(len(self.scheduler.running)):
            return bool(inflight.drafts)
        return bool(inflight.drafts) or any(
            pool.wants_to_draft(seq) for seq in inflight.plan.scheduled_seqs if not seq.is_finished
        )

    def _can_defer_masks(self) -> bool:
        """Whether a step's grammar masks may wait for the host work overlapped with its
        forward (``structured.DeferredMasks``): only where nothing waits for the launched step
        before that host work (no KV store, EPLB or DP group; not a role whose hooks read the
        KV of the step just launched, a PE's hand-off)."""
        return (
            self.role.defers_grammar_masks
            and self.kv_store is None
            and self.eplb is None
            and self.scheduler.dp_group.size == 1
        )

    def _launch(self, plan: SchedulerOutputs, in_flight: InFlight | None = None) -> InFlight | None:
        """Build and launch the plan's step. ``in_flight``: the step still in flight, which the
        new step's grammar masks wait for (``structured.DeferredMasks``)."""
        # In a voting DP group a rank's companion empty prefill step still runs an (empty)
        # forward, so every rank keeps the same beat.
        dp_group = self.scheduler.dp_group
        companion = plan.prompt_run and dp_group.size > 1 and self.engine_type.votes_on_step_type
        # With expert parallelism every step meets the other ranks in every MoE layer's
        # all-to-all, so a rank with nothing to run still runs an empty forward.
        companion = companion or self.model_runner.dispatcher is not None
        if plan.is_empty and not plan.clone_blocks and not companion:
            return None
        inp, owners, prompt_owners = self.step_builder.build(plan, defer_masks=in_flight is not None)
        if in_flight is not None:
            from pdinfer.engine.structured import DeferredMasks

            grammars = {
                i: seq.grammar
                for i, (seq, _) in enumerate(owners)
                if inp.samples[i].masked_later and seq.grammar is not None
            }
            inp.masks_later = DeferredMasks(lambda: self._post_process_step(in_flight), grammars)
        drafts = {seq.seq_id: list(seq.draft_token_ids) for seq in plan.scheduled_seqs if seq.draft_token_ids}
        return InFlight(plan, inp, owners, self.executor.launch(inp), prompt_owners, drafts)

    def pre_sampler_sync(self, plan: SchedulerOutputs) -> None:
        if not plan.prompt_run:
            if self.copy_state_event is not None:
                self.copy_state_event.result()
                self.copy_state_event = None
            self.do_save_kvcache(plan.scheduled_seqs, plan.finished_seqs)
        else:
            self.pe_prepare_save_kvcache(plan.scheduled_seqs, plan.finished_seqs)
        if self.role.finalizes_seqs:
            # PROMPT never finalizes: its sequences are handed over, and their blocks are freed
            # only once the hand-over is confirmed.
            for seq in plan.finished_seqs:
                self.finalize_seq(seq)

    def _post_process_step(self, inflight: InFlight) -> list[RequestDelta]:
        result = inflight.future.result()  # the sampling sync
        return self.post_process(inflight, result)

    def post_process(self, inflight: InFlight, result) -> list[RequestDelta]:
        outputs = self.output_processor.process(inflight, result)
        plan = inflight.plan
        if plan.prompt_run:
            self.pe_do_save_kvcache(plan.scheduled_seqs, plan.finished_seqs)
        if self.role.hands_off_prompts:  # PROMPT
            self.send_processed_prompts()
        return outputs

    def _report(self, state: RequestState) -> RequestDelta:
        delta = state.make_delta()
        if delta.finished:
            self.requests.pop(state.request_id, None)
            if delta.migrate is not None:
                self.num_migrated += 1
                num_tokens = max((seq.num_output_tokens for seq in state.seqs), default=0)
                logger.info(
                    "request %s leaves this engine (%s) after %d output tokens; its client continues it elsewhere",
                    state.request_id,
                    delta.migrate,
                    num_tokens,
                )
        return delta

    def shutdown(self) -> None:
        if self._inflight is not None:
            self._inflight.future.result()
            self._inflight = None
        if self.kv_store is not None:
            self.kv_store.close()  # writes the saves still queued
        self.executor.shutdown()
        self.role.shutdown()  # a P/D role's connector


def _device_and_dtype(args: EngineArgs) -> tuple[torch.device, torch.dtype]:
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        if args.dtype not in names:
            raise ValueError(f"dtype must be auto or one of {list(names)}, got {args.dtype!r}")
        dtype = names[args.dtype]
    if device.type == "cpu" and args.num_threads is None and os.cpu_count():
        torch.set_num_threads(os.cpu_count() or 1)
    return device, dtype


def _no_bools(token_ids):
    """Token ids a caller gave, refused if any is a bool (``array("q")`` takes True for 1); the
    tokenizer's own ids skip this pass."""
    if isinstance(token_ids, list) and bool in set(map(type, token_ids)):
        raise ValueError("prompt token ids must be integers, not true or false")
    return token_ids

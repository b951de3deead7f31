"""``PrefillRole``: a PROMPT engine ("PE") hands each prefilled request, its K/V and its first
token to a completion engine (CE).

A request whose CE this PE has not shaken hands with yet waits beside the scheduler until the
handshake ends (``add_request`` never blocks: a silent CE costs its own requests their
handshake timeout, and nobody else anything).

Hook by hook (the seed's step order):
- ``init_pd_split``: start the connector once the KV cache exists;
- ``post_schedule``: note which sequences finish their prompt this step; collect CE acks and
  expired leases; release aborted sequences that are not in transfer; enqueue requests whose
  CE answered the handshake (fail those it refused);
- ``pe_prepare_save_kvcache``: queue the K/V copy of those sequences behind the forward (it
  overlaps the sampling sync);
- ``pe_do_save_kvcache``: the first token is known now: push K/V + token to the CE;
- ``send_processed_prompts``: take them out of the scheduler. Their blocks stay ours until the
  CE confirms (or the lease runs out): a block is never freed while its K/V may still be read.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import ClassVar

from pdinfer.core.outputs import SchedulerOutputs
from pdinfer.engine.pd_common import Handoff, KVTransferConfig, Reservation, kv_layout
from pdinfer.engine.roles.base import EngineView, Role
from pdinfer.engine_type import EngineType
from pdinfer.kv_transfer.connector import HandshakeError, KVConnector
from pdinfer.kv_transfer.protocol import KVAbort, KVAck, KVPush
from pdinfer.outputs import Resume
from pdinfer.sampling_params import SamplingParams
from pdinfer.sequence import Sequence, SequenceStatus


class PrefillRole(Role):
    engine_type: ClassVar[EngineType] = EngineType.PROMPT
    pd_split = True
    decodes = False  # so no decode CUDA graphs either
    finalizes_seqs = False  # PROMPT never calls finalize_seq: its blocks go on the CE's ack
    hands_off_prompts = True
    first_tokens_only = True  # no stop checks, no forks: the CE does both
    ends_on_stop_strings = False  # stop strings are the decode side's business
    defers_grammar_masks = False  # the hand-off reads the K/V of the step just launched
    saves_kv_store = False  # a PE's prompts are saved by their CE
    connector: KVConnector  # from init_pd_split on
    handoff_stats: dict[str, float]

    def __init__(self, engine: EngineView):
        super().__init__(engine)
        # Parsed before the model loads: a bad setting fails at once.
        self.pd_config = KVTransferConfig.from_dict(engine.args.kv_transfer, engine.args.kv_secret)
        self.handoffs: dict[str, Sequence] = {}  # transfer id -> sequence awaiting the CE's ack
        self.handoff_stats = {"count": 0, "bytes": 0, "seconds": 0.0, "failed": 0}
        self._completing: list[Sequence] = []  # this step's finished prefills
        self._pushed: list[Sequence] = []  # pushed by the last pe_do_save_kvcache
        self._handshakes: dict[str, Future] = {}  # CE address -> its handshake under way
        self._awaiting_peer: list[tuple[Sequence, bool]] = []  # (sequence, enqueue) until then

    # --- hooks -----------------------------------------------------------------------------------
    def init_pd_split(self) -> None:
        engine = self.engine
        self.connector = self.pd_config.make_connector(
            listen=False, engine_type=engine.engine_type.value, device=engine.device
        )
        self.connector.register(kv_layout(engine))

    def post_schedule(self, plan: SchedulerOutputs) -> None:
        for seq in plan.finished_seqs:  # aborted before they were handed over
            if seq.handoff is None or not seq.handoff.sent:
                self._release(seq)
                self._tell_ce_nothing_comes(seq)
        self._completing = [seq for seq, done in zip(plan.scheduled_seqs, plan.do_sample) if done]
        self._collect_acks()
        self._collect_handshakes()

    def check_plan(self, plan: SchedulerOutputs) -> None:
        if not plan.prompt_run:
            # A decode step on a PE would skip pe_do_save_kvcache: its hand-off would be lost.
            raise RuntimeError("a PROMPT engine scheduled a decode step")

    def pe_prepare_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        bm = self.engine.block_manager
        for seq in self._completing:
            blocks = seq.block_table[: bm.blocks_for(seq.num_handoff_tokens)]
            seq.handoff.kv_future = self.engine.executor.submit_call(self._read_kv, blocks)

    def _read_kv(self, blocks: list[int]):
        """Step thread, after the forward that wrote ``blocks``: the transaction's copy-out."""
        return self.connector.stage_blocks(self.engine.model_runner.require_cache(), blocks)

    def pe_do_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        # ``scheduled`` is the step being post-processed: with zero-overhead scheduling that is
        # the previous one, and ``_completing`` already belongs to the step after it.
        now = time.monotonic()
        ready = [seq for seq in scheduled if seq.handoff is not None and seq.handoff.kv_future is not None]
        self._pushed = []
        for seq in ready:
            if not seq.is_finished and now > seq.handoff.expires_at:
                # The CE has dropped the reservation: its blocks may hold another request now.
                error = "the completion engine's reservation expired before the prefill finished"
                self.engine.requests[seq.request_id].error = error
                self.engine.abort_request(seq.request_id)
            if seq.is_finished:  # aborted while its prefill ran
                continue
            self._push(seq, now)
            self._pushed.append(seq)

    def send_processed_prompts(self) -> None:
        for seq in self._pushed:
            self.engine.scheduler.remove_seq(seq)
        self._pushed = []

    # --- requests ----------------------------------------------------------------------------------
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
        """Prefill ``prompt`` (and, for a migrated request, the tokens it had: ``resume``) and
        hand it to the CE that made ``reservation`` (ValueError for a reservation that cannot
        be one, checked as if from a stranger)."""
        if reservation is None:
            raise ValueError("a prefill engine needs a reservation from a completion engine")
        if reservation.request_id != request_id:
            raise ValueError("the reservation belongs to another request")
        reservation.check(num_blocks_needed=0)
        self.connector.check_address(reservation.address)
        engine = self.engine
        seq = engine.build_request(request_id, prompt, sampling_params, arrival_time, False, resume)
        # n > 1: the n first tokens ride on this one sequence (the CE forks): it alone ends the
        # request here (else the request would never count as finished on the PE).
        engine.requests[request_id].expected_seqs = 1
        error = None
        if seq.num_handoff_tokens != reservation.num_prompt_tokens:
            error = (
                f"the reservation is for {reservation.num_prompt_tokens} prompt tokens, "
                f"the prompt has {seq.num_handoff_tokens}"
            )
        elif len(reservation.block_ids) < engine.block_manager.blocks_for(seq.num_handoff_tokens):
            error = "the reservation's block_ids hold fewer blocks than the prompt needs"
        if error is not None:
            engine.unbuild_request(request_id)
            raise ValueError(error)
        seq.handoff = Handoff(reservation=reservation)
        if reservation.timeout_s is not None:
            seq.handoff.expires_at = time.monotonic() + reservation.timeout_s
        if self.connector.peer_instance(reservation.address) == reservation.instance_id:
            if enqueue:
                engine.scheduler.add_sequence(seq)
        else:
            self._await_handshake(seq, enqueue)
        return seq

    def abort_request(self, request_id: str) -> bool:
        state = self.engine.requests.get(request_id)
        self._awaiting_peer = [(s, e) for s, e in self._awaiting_peer if s.request_id != request_id]
        if state is not None:
            for seq in state.seqs:
                if seq.handoff is not None and seq.handoff.sent and not seq.is_finished:
                    self._fail(seq, "aborted", notify_ce=True)
        return False  # the engine's own abort follows

    def waits_on_peers(self) -> bool:
        return bool(self.handoffs) or bool(self._awaiting_peer)

    def poll_peers(self) -> None:
        self._collect_acks()  # an ack frees blocks and ends the request
        self._collect_handshakes()  # a shaken hand enqueues its requests: step work

    def shutdown(self) -> None:
        self.connector.close()

    # --- handshakes --------------------------------------------------------------------------------
    def _await_handshake(self, seq: Sequence, enqueue: bool) -> None:
        address = seq.handoff.reservation.address
        if address not in self._handshakes:
            self._handshakes[address] = self.connector.start_connect(address, self.pd_config.handshake_timeout_s)
        self._awaiting_peer.append((seq, enqueue))
        self._collect_handshakes()  # an in-process connector answers at once

    def _collect_handshakes(self) -> None:
        for address, future in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[address]
            try:
                instance, error = self.connector.finish_connect(address, future), None
            except HandshakeError as exc:
                instance, error = None, str(exc)
            waiting, self._awaiting_peer = self._awaiting_peer, []
            for seq, enqueue in waiting:
                reservation = seq.handoff.reservation
                if seq.is_finished:
                    continue  # aborted meanwhile
                if reservation.address != address:
                    self._awaiting_peer.append((seq, enqueue))
                elif error is not None:
                    self._fail(seq, error)
                elif instance != reservation.instance_id:
                    self._fail(seq, f"the CE at {address} restarted since it made the reservation")
                elif enqueue:
                    self.engine.scheduler.add_sequence(seq)

    # --- the hand-off ------------------------------------------------------------------------------
    def _push(self, seq: Sequence, now: float) -> None:
        reservation: Reservation = seq.handoff.reservation
        data, nbytes, crc = seq.handoff.kv_future.result().finish()
        num_blocks = self.engine.block_manager.blocks_for(seq.num_handoff_tokens)
        push = KVPush(
            transfer_id=reservation.transfer_id,
            request_id=seq.request_id,
            instance_id=reservation.instance_id,
            num_tokens=seq.num_handoff_tokens,
            first_token=seq.first_tokens[0],
            first_tokens=list(seq.first_tokens),
            seed=seq.seed,
            block_ids=reservation.block_ids[:num_blocks],
            nbytes=nbytes,
            checksum=crc,
            first_logprobs=seq.output_logprobs[seq.num_resumed_tokens] if seq.output_logprobs else None,
        )
        self.connector.send(reservation.address, push, data)
        seq.handoff.kv_future = None
        seq.handoff.sent, seq.handoff.started = True, now
        seq.handoff.deadline, seq.handoff.nbytes = now + self.pd_config.lease_s, nbytes
        seq.status = SequenceStatus.HANDED_OFF
        self.handoffs[reservation.transfer_id] = seq

    def _tell_ce_nothing_comes(self, seq: Sequence) -> None:
        """A request dropped before its push: the CE may free its reservation now (a transport
        writing in place would otherwise keep those blocks until the reservation times out)."""
        if seq.handoff is not None:
            reservation = seq.handoff.reservation
            self.connector.abort(
                reservation.address, KVAbort(transfer_id=reservation.transfer_id, request_id=seq.request_id)
            )

    def _collect_acks(self) -> None:
        for event in self.connector.events():
            if not isinstance(event, KVAck):
                continue
            seq = self.handoffs.pop(event.transfer_id, None)
            if seq is None:
                continue
            if event.ok:
                self.handoff_stats["count"] += 1
                self.handoff_stats["bytes"] += seq.handoff.nbytes
                self.handoff_stats["seconds"] += time.monotonic() - seq.handoff.started
                self._finish(seq, SequenceStatus.FINISHED_HANDED_OFF, None)
            else:
                self._fail(seq, f"the completion engine refused the hand-off: {event.error}")
        now = time.monotonic()
        for seq in list(self.handoffs.values()):
            if now > seq.handoff.deadline:
                self._fail(
                    seq,
                    f"no confirmation from the completion engine within {self.pd_config.lease_s:.0f} s (lease expired)",
                    notify_ce=True,
                )

    def _fail(self, seq: Sequence, error: str, notify_ce: bool = False) -> None:
        reservation = seq.handoff.reservation
        self.handoffs.pop(reservation.transfer_id, None)
        if notify_ce:
            self.connector.abort(
                reservation.address, KVAbort(transfer_id=reservation.transfer_id, request_id=seq.request_id)
            )
        self.handoff_stats["failed"] += 1
        self._finish(seq, SequenceStatus.FINISHED_ABORTED, error)

    def _finish(self, seq: Sequence, status: SequenceStatus, error: str | None) -> None:
        seq.finish(status, error=error)
        self._release(seq)
        state = self.engine.requests.get(seq.request_id)
        if state is not None:
            if error:
                state.error = error
            self.engine.publish(state)

    def _release(self, seq: Sequence) -> None:
        # PROMPT never goes through finalize_seq: this is the only place a PE frees blocks.
        if seq.handoff is not None and seq.handoff.kv_future is not None:
            seq.handoff.kv_future.result().release()  # a copy still reading these blocks, never sent
        self.engine.scheduler.free_seq(seq)
        self.engine.step_builder.forget(seq)

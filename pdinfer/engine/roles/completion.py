"""``CompletionRole``: a COMPLETION engine ("CE") takes requests over from prefill engines.

Decode allocates first: ``reserve`` builds the sequence with ``add_request(enqueue=False)`` and
takes blocks for the prompt plus a decode margin, or refuses at once when there is no room
(back-pressure: the caller picks another CE). The PE pushes K/V into those blocks; the sequence
is enqueued into ``prompted`` only once everything arrived and checked out (request id, token
count, block list, size, checksum). It is never re-prefilled here: a CE has no prefill channel.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from typing import ClassVar

from pdinfer.core.outputs import SchedulerOutputs
from pdinfer.engine.pd_common import KVTransferConfig, NoRoomError, Reservation, kv_layout
from pdinfer.engine.roles.base import EngineView, Role
from pdinfer.engine_type import EngineType
from pdinfer.kv_transfer.connector import Arrival, KVConnector
from pdinfer.kv_transfer.protocol import KVAbort
from pdinfer.outputs import Resume
from pdinfer.sampling_params import SamplingParams
from pdinfer.sequence import Sequence, SequenceStatus

logger = logging.getLogger("pdinfer")

__all__ = ["CompletionRole", "NoRoomError"]


class CompletionRole(Role):
    engine_type: ClassVar[EngineType] = EngineType.COMPLETION
    pd_split = True
    loads_kv_store = False  # it never prefills: its prompts' K/V come from the PE
    migrates_on_drain = True  # a request is never recomputed here: it leaves for another CE
    connector: KVConnector  # from init_pd_split on

    def __init__(self, engine: EngineView):
        super().__init__(engine)
        # Parsed before the model loads: a bad setting fails at once.
        self.pd_config = KVTransferConfig.from_dict(engine.args.kv_transfer, engine.args.kv_secret)
        self.reservations: dict[str, Sequence] = {}  # transfer id -> sequence waiting for its K/V
        # transfer id -> (blocks, deadline) of dropped reservations a PE may still write into
        self.quarantined: dict[str, tuple[list[int], float]] = {}
        self.refused_transfers = 0

    def init_pd_split(self) -> None:
        engine = self.engine
        cache = engine.model_runner.require_cache()
        block_size = engine.cache_config.block_size
        max_push_blocks = min(engine.num_blocks, -(-engine.scheduler_config.max_model_len // block_size))
        self.connector = self.pd_config.make_connector(
            listen=True,
            engine_type=engine.engine_type.value,
            device=engine.device,
            max_push_blocks=max_push_blocks,  # what its KV port reads is bounded by the largest push
            bytes_per_block=cache.bytes_per_block,
        )
        self.connector.register_kv_cache(cache.kv)  # before the handshake can answer
        self.connector.register(kv_layout(engine))
        self.connector.check_address(self.kv_address)  # a bad advertise_host fails at start, not per request

    @property
    def kv_address(self) -> str:
        """Where reservations send PEs: the connector's bind address, or ``advertise_host`` at
        the same port when PEs reach this CE by another address (NAT, a proxy or relay)."""
        address, host = self.connector.address, self.pd_config.advertise_host
        return address if host is None else f"tcp://{host}:{address.rsplit(':', 1)[1]}"

    # --- reservations --------------------------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        resume: Resume | None = None,
    ) -> Reservation:
        """Blocks for the K/V a PE will push: the prompt's, and a migrated request's tokens so
        far (``resume``), plus a decode margin."""
        engine = self.engine
        seq = engine.add_request(request_id, prompt, sampling_params, arrival_time, enqueue=False, resume=resume)
        bm = engine.block_manager
        # never more than the request can use (add_request admitted prompt + max_tokens - 1)
        margin = min(self.pd_config.decode_margin_tokens, seq.max_tokens - seq.num_resumed_tokens - 1)
        needed = bm.blocks_for(seq.num_handoff_tokens + margin)
        if needed > bm.num_free_blocks or len(engine.scheduler.running) >= engine.scheduler_config.max_num_seqs:
            engine.unbuild_request(request_id)
            raise NoRoomError(
                f"no room for {seq.num_handoff_tokens} prompt tokens: {bm.num_free_blocks} "
                f"free KV blocks, {needed} needed"
            )
        seq.block_table = bm.allocate_blocks(needed)
        transfer_id = uuid.uuid4().hex
        seq.handoff = {"transfer_id": transfer_id, "deadline": time.monotonic() + self.pd_config.reservation_timeout_s}
        self.reservations[transfer_id] = seq
        # From now on the KV port lets this transfer's push (of exactly its prompt's blocks) through.
        nbytes = bm.blocks_for(seq.num_handoff_tokens) * engine.model_runner.require_cache().bytes_per_block
        self.connector.gate.expect(transfer_id, request_id, nbytes)
        return Reservation(
            transfer_id=transfer_id,
            request_id=request_id,
            address=self.kv_address,
            instance_id=self.connector.instance_id,
            block_ids=list(seq.block_table),
            num_prompt_tokens=seq.num_handoff_tokens,
            timeout_s=self.pd_config.reservation_timeout_s,
        )

    def admit(
        self,
        request_id: str,
        prompt,
        sampling_params: SamplingParams,
        reservation: Reservation | None,
        resume: Resume | None = None,
    ) -> Reservation:
        """Decode allocates first: the client (the router, through this CE's server) gets the
        reservation to hand to a PE, or ``NoRoomError`` at once."""
        if reservation is not None:
            raise ValueError("a completion engine makes reservations; it does not take one")
        return self.reserve(request_id, prompt, sampling_params, resume=resume)

    def begin_step(self) -> None:
        self._accept_arrivals()

    def post_schedule(self, plan: SchedulerOutputs) -> None:
        kv_store = self.engine.kv_store
        if kv_store is not None and plan.given_up:  # before this step may write their blocks
            kv_store.save_leaving(plan.given_up)

    def waits_on_peers(self) -> bool:
        return bool(self.reservations) or bool(self.quarantined)

    def poll_peers(self) -> None:
        self._accept_arrivals()  # an accepted arrival is step work from now on

    def abort_request(self, request_id: str) -> bool:
        for transfer_id, seq in list(self.reservations.items()):
            if seq.request_id == request_id:
                # A copying transport writes only when the arrival is accepted (on this thread):
                # free at once. An in-place one may be writing now: quarantine the blocks.
                self._drop_reservation(transfer_id, "aborted", quarantine=self.connector.writes_in_place)
                return True
        return False

    def shutdown(self) -> None:
        self.connector.close()

    # --- arrivals ------------------------------------------------------------------------------------
    def _accept_arrivals(self) -> None:
        for event in self.connector.events():
            if isinstance(event, KVAbort) and event.transfer_id in self.quarantined:
                self._release_quarantine(event.transfer_id)
            elif isinstance(event, KVAbort) and event.transfer_id in self.reservations:
                # A PE sends its abort after any write of that transfer: the blocks are free to go.
                self._drop_reservation(event.transfer_id, "aborted by the prefill engine")
            elif isinstance(event, KVAbort) and event.request_id in self.engine.requests:
                # its transfer was taken over; the port checked the abort comes from its owner
                self.engine.drop_request(event.request_id)
        for arrival in self.connector.receive():
            self._accept(arrival)
        now = time.monotonic()
        for transfer_id, seq in list(self.reservations.items()):
            if now > seq.handoff["deadline"]:
                self._drop_reservation(
                    transfer_id,
                    f"the prefill engine did not deliver the K/V in {self.pd_config.reservation_timeout_s:.0f} s",
                    quarantine=self.connector.writes_in_place,
                )
        for transfer_id, (_, deadline) in list(self.quarantined.items()):
            if now > deadline:
                self._release_quarantine(transfer_id)

    def _accept(self, arrival: Arrival) -> None:
        push, engine = arrival.push, self.engine
        seq = self.reservations.get(push.transfer_id)
        error = self._verify(arrival, seq)
        if error is not None:
            self.refused_transfers += 1
            logger.warning("refused K/V for transfer %s: %s", push.transfer_id, error)
            self.connector.confirm(arrival, ok=False, error=error)
            if seq is not None:  # a corrupted transfer is refused, never decoded
                self._drop_reservation(push.transfer_id, f"K/V hand-off refused: {error}")
            self._release_quarantine(push.transfer_id)  # its push comes after its write
            return
        assert seq is not None  # _verify refuses a transfer without a reservation
        del self.reservations[push.transfer_id]
        self.connector.gate.finish(push.transfer_id)
        self.connector.confirm(arrival, ok=True)
        seq.seed = push.seed
        seq.num_computed_tokens = push.num_tokens
        seq.handoff = None
        engine.output_processor.accept_first_tokens(seq, push.first_tokens or [push.first_token], push.first_logprobs)
        if not seq.is_finished:
            engine.scheduler.add_prompted(seq)
        engine.publish(engine.requests[seq.request_id])

    def _verify(self, arrival: Arrival, seq: Sequence | None) -> str | None:
        push, engine = arrival.push, self.engine
        cache = engine.model_runner.require_cache()
        if seq is None and push.transfer_id in self.quarantined:
            return "the request was aborted on the completion engine"
        if seq is None:
            return f"unknown or expired transfer {push.transfer_id}"
        if push.instance_id != self.connector.instance_id:
            return "the reservation was made with an earlier instance of this engine"
        if push.request_id != seq.request_id:
            return f"request id {push.request_id!r} does not match the reservation ({seq.request_id!r})"
        if push.num_tokens != seq.num_handoff_tokens:
            return f"{push.num_tokens} tokens of K/V for a prompt of {seq.num_handoff_tokens}"
        expected_blocks = engine.block_manager.blocks_for(push.num_tokens)
        if list(push.block_ids) != seq.block_table[:expected_blocks]:
            return "the K/V targets blocks that were not reserved for it"
        if push.nbytes != expected_blocks * cache.bytes_per_block:
            return f"payload of {push.nbytes} bytes, expected {expected_blocks * cache.bytes_per_block}"
        tokens = push.first_tokens or [push.first_token]
        vocab = engine.spec.vocab_size
        if len(tokens) != seq.sampling_params.n or any(not 0 <= t < vocab for t in tokens):
            return "invalid first tokens"
        if not 0 <= push.seed < 2**63:
            return "invalid seed"
        logprobs = push.first_logprobs
        wanted = seq.sampling_params.logprobs
        if logprobs is not None and (
            wanted is None
            or len(logprobs) > wanted + 1
            or any(not 0 <= t < vocab or math.isnan(lp) for t, lp in logprobs.items())
        ):
            return "invalid first-token logprobs"
        # The transaction's landing, last: the K/V into our reserved blocks (or, written in place
        # already, read there) in step order, its checksum checked where it landed.
        return engine.executor.submit_call(self.connector.land, arrival, cache).result()

    def _drop_reservation(self, transfer_id: str, error: str, quarantine: bool = False) -> None:
        seq = self.reservations.pop(transfer_id, None)
        if seq is None:
            return
        if quarantine:  # a block being written is never freed: wait for the PE's push or abort
            deadline = time.monotonic() + self.pd_config.reservation_timeout_s
            self.quarantined[transfer_id] = (seq.block_table, deadline)  # (the gate still lets them in)
            seq.block_table = []
        else:
            self.connector.gate.forget(transfer_id)
            self.engine.block_manager.free(seq)
        seq.finish(SequenceStatus.FINISHED_ABORTED, error=error)
        state = self.engine.requests.get(seq.request_id)
        if state is not None:
            state.error = error
            state.expected_seqs = len(state.seqs)
            self.engine.publish(state)

    def _release_quarantine(self, transfer_id: str) -> None:
        self.connector.gate.forget(transfer_id)
        blocks, _ = self.quarantined.pop(transfer_id, (None, 0.0))
        if blocks is not None:
            self.engine.block_manager.free_blocks(blocks)

"""Role-aware continuous-batching scheduler (pure Python).

A step is either a prefill step (``prompt_run``) or a decode step, never both:
- PROMPT engines only prefill (an empty prompt_run plan when nothing waits, never None);
- COMPLETION engines only decode (sequences arrive through ``prompted``);
- NORMAL engines decide per step, by the DP vote at ALL/ANY points (see ``_schedule_normal``).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from pdinfer.config import SchedulerConfig
from pdinfer.core.block_manager import BlockManager
from pdinfer.core.dp import DPGroup, SingleProcessDPGroup
from pdinfer.core.outputs import SchedulerOutputs
from pdinfer.core.spec_decode import DraftPool
from pdinfer.core.state_manager import StateManager
from pdinfer.engine_type import EngineType
from pdinfer.sequence import Sequence, SequenceStatus

logger = logging.getLogger("pdinfer")

PREEMPTED_ERROR = (
    "preempted: the KV cache ran out of blocks and this engine stops preempted requests "
    "(stop_preempted_request); retry, or give the engine more KV memory"
)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        dp_group: DPGroup | None = None,
        state_manager: StateManager | None = None,
        draft_pool: DraftPool | None = None,
    ):
        self.config = config
        self.engine_type = EngineType.from_int(config.engine_type)
        self.block_manager = block_manager
        self.state_manager = state_manager
        self.draft_pool = draft_pool  # speculative decoding (NORMAL and COMPLETION only)
        self.dp_group: DPGroup = dp_group or SingleProcessDPGroup()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prompted: deque[tuple[Sequence, bool]] = deque()  # (sequence, forked)
        self.finished: list[Sequence] = []  # finished since the last plan; finalized with it
        self.decode_step = 0  # decode steps since the last prefill step (NORMAL)
        self.num_preemptions = 0
        if self.capacity_tokens < config.max_model_len:
            logger.warning(
                "the KV cache holds %d tokens (%d blocks of %d), fewer than max_model_len=%d: a request "
                "that needs more is refused, an open-ended one ends with finish_reason 'length'",
                self.capacity_tokens,
                block_manager.num_total_blocks,
                block_manager.block_size,
                config.max_model_len,
            )

    @property
    def capacity_tokens(self) -> int:
        """K/V slots in the whole cache: no sequence ever holds more."""
        return self.block_manager.num_total_blocks * self.block_manager.block_size

    # --- entry points ------------------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        """Refuse (ValueError) a new sequence the KV cache could never hold, even alone: it would
        wait, or preempt itself, forever. An open-ended output (no max_tokens) is bounded by the
        cache instead, and ends with finish_reason "length" there."""
        capacity, prompt = self.capacity_tokens, seq.num_prompt_tokens
        if prompt > capacity:
            raise ValueError(f"prompt of {prompt} tokens can never fit in this engine's KV cache ({capacity} tokens)")
        if self.engine_type is EngineType.PROMPT:
            return  # a PE holds the prompt only; the CE holds the output
        needed = prompt + seq.max_tokens - 1  # the last output token is never computed
        if needed <= capacity:
            return
        if seq.sampling_params.max_tokens is None:
            seq.max_tokens = capacity - prompt + 1
            return
        raise ValueError(
            f"prompt of {prompt} tokens with max_tokens {seq.max_tokens} needs {needed} tokens of KV "
            f"cache, this engine's holds {capacity}: lower max_tokens to {capacity - prompt + 1} or less"
        )

    def add_sequence(self, seq: Sequence) -> None:
        seq.arrival_time = time.monotonic()
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_prompted(self, seq: Sequence, forked: bool = False) -> None:
        """A sequence whose prefix K/V is already in its blocks (e.g. handed over by a PE)."""
        if seq.num_computed_tokens != seq.num_tokens - 1 or not seq.block_table:
            raise ValueError(f"{seq} is not ready to decode: needs all but its last token computed")
        seq.status = SequenceStatus.PROMPTED
        self.prompted.append((seq, forked))

    def fork_seq(
        self,
        seq: Sequence,
        blocks: list[int] | None = None,
        *,
        replace_last_token_id: int | None = None,
        index: int | None = None,
        seed: int | None = None,
    ) -> Sequence:
        """A new sequence continuing ``seq``'s computed prefix.

        ``blocks=None`` shares ``seq``'s blocks (the last, partly written one is copied before
        the fork first writes, see ``_schedule_decode``); an explicit list hands those blocks,
        which must already hold the prefix, to the fork (the shape of a P/D hand-off). A parent
        preempted for recompute (waiting, nothing computed: zero-overhead scheduling preempted
        it while its first tokens were in flight) gives a fork that recomputes too.
        """
        recomputing = (
            seq.num_computed_tokens <= 0 and seq.status is SequenceStatus.WAITING and seq.num_output_tokens > 0
        )
        if seq.num_computed_tokens <= 0 and (blocks is not None or not recomputing):
            raise ValueError("Cannot fork a sequence without a computed prefix")
        fork = Sequence(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            sampling_params=seq.sampling_params,
            seed=seq.seed if seed is None else seed,
            index=seq.index if index is None else index,
            arrival_time=seq.arrival_time,
            max_tokens=seq.max_tokens,
            eos_token_ids=seq.eos_token_ids,
        )
        fork.token_ids = list(seq.token_ids)
        if replace_last_token_id is not None:
            fork.token_ids[-1] = replace_last_token_id
        fork.num_computed_tokens = min(seq.num_computed_tokens, len(fork.token_ids) - 1)
        num_blocks = self.block_manager.blocks_for(fork.num_computed_tokens)
        if blocks is None:
            fork.block_table = self.block_manager.share(seq.block_table[:num_blocks])
        else:
            if not blocks:
                raise ValueError("Cannot fork a sequence without allocated KV blocks")
            fork.block_table = list(blocks)
        bs = self.block_manager.block_size
        fork.block_hashes = seq.block_hashes[: fork.num_computed_tokens // bs]
        fork.state_source = seq.state_id  # cloned into a slot of its own before it runs
        if fork.num_computed_tokens < fork.num_tokens - 1:
            fork.status = SequenceStatus.WAITING
            self._put_back(fork)
        else:
            fork.status = SequenceStatus.PROMPTED
            self.prompted.append((fork, True))
        return fork

    def abort(self, request_id: str) -> list[Sequence]:
        """Remove every sequence of a request; they are finalized with the next plan."""
        aborted = [s for s in self.waiting if s.request_id == request_id]
        aborted += [s for s in self.running if s.request_id == request_id]
        aborted += [s for s, _ in self.prompted if s.request_id == request_id]
        if not aborted:
            return []
        ids = {s.seq_id for s in aborted}
        self.waiting = deque(s for s in self.waiting if s.seq_id not in ids)
        self.running = [s for s in self.running if s.seq_id not in ids]
        self.prompted = deque((s, f) for s, f in self.prompted if s.seq_id not in ids)
        for seq in aborted:
            seq.finish(SequenceStatus.FINISHED_ABORTED, error=seq.error)
            self.finished.append(seq)
        return aborted

    def finish_seq(self, seq: Sequence) -> None:
        """Called when a sequence finished; its blocks are freed when the next plan is finalized."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # preempted for recompute while its last token was in flight
            self.waiting.remove(seq)
        else:  # a fork (or a CE's arrival) that ended on its first token, before it ever ran
            self.prompted = deque((s, f) for s, f in self.prompted if s is not seq)
        self._release_draft_slot(seq)
        self.finished.append(seq)

    def free_seq(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self._free_state(seq)
        self._release_draft_slot(seq)

    def _release_draft_slot(self, seq: Sequence) -> None:
        if self.draft_pool is not None:
            self.draft_pool.release(seq)

    def _free_state(self, seq: Sequence) -> None:
        if self.state_manager is not None and seq.state_id >= 0:
            self.state_manager.free(seq.state_id)
            seq.state_id = -1

    def remove_seq(self, seq: Sequence) -> None:
        """Forget a sequence without freeing its blocks (a PE hands them over)."""
        if seq in self.running:
            self.running.remove(seq)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.prompted or self.finished)

    # --- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutputs:
        outputs = self._schedule()
        outputs.finished_seqs, self.finished = self.finished, []
        return outputs

    def _schedule(self) -> SchedulerOutputs:
        match self.engine_type:
            case EngineType.PROMPT:
                # A PE has no decode channel: even with nothing waiting it returns an (empty)
                # prefill plan, so the caller never falls through to decode.
                plan = self._schedule_prefill()
                if plan is None:
                    raise RuntimeError("_schedule_prefill returned None for a PROMPT engine")
                return plan
            case EngineType.COMPLETION:
                return self._schedule_decode()
            case EngineType.NORMAL:
                return self._schedule_normal()
        raise RuntimeError(f"unknown engine_type {self.engine_type!r}")

    def _schedule_normal(self) -> SchedulerOutputs:
        """The DP vote: every rank of the group takes the same step type."""
        cfg, dp = self.config, self.dp_group
        is_any_point = self.decode_step != 0 and self.decode_step % cfg.prefill_any_attempt_interval == 0
        is_all_point = self.decode_step % cfg.prefill_attempt_interval == 0
        # With nothing to decode on any rank a decode step would idle: treat it as an ANY point,
        # so the engine never sits idle while a request waits.
        idle = 1 if not (self.running or self.prompted) else 0
        if dp.all_reduce_min([idle])[0] == 1:
            is_any_point = True
        if not is_any_point and not is_all_point:
            return self._decode_step()
        want = self.block_manager.usage() <= cfg.prefill_kv_watermark and bool(self.waiting)
        if is_any_point:  # prefill if any rank wants
            do_prefill = dp.all_reduce_min([0 if want else 1])[0] == 0
        else:  # ALL point: prefill only if every rank wants
            do_prefill = dp.all_reduce_min([1 if want else 0])[0] == 1
        if not do_prefill:
            return self._decode_step()
        outputs = self._schedule_prefill() if want else None
        # Second vote: "want" does not guarantee anything was schedulable (max_num_seqs full, no
        # blocks). If nobody scheduled, everyone decodes -- otherwise "running full + waiting"
        # would loop on empty prefill steps forever.
        if dp.all_reduce_min([0 if outputs is not None else 1])[0] == 1:
            return self._decode_step()
        self.decode_step = 0
        if outputs is not None:
            return outputs
        # Some other rank prefills: run an empty prefill step alongside it.
        return SchedulerOutputs(prompt_run=True)

    def _decode_step(self) -> SchedulerOutputs:
        self.decode_step += 1
        return self._schedule_decode()

    def _schedule_prefill(self) -> SchedulerOutputs | None:
        cfg, bm = self.config, self.block_manager
        outputs = SchedulerOutputs(prompt_run=True)
        budget = cfg.max_num_batched_tokens
        is_chunked = False
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted while its last token was in flight; wait until it lands
            if seq.num_computed_tokens == 0 and seq.num_tokens > cfg.prompt_limit:
                self.waiting.popleft()
                seq.finish(
                    SequenceStatus.FINISHED_IGNORED,
                    error=(
                        f"prompt of {seq.num_tokens} tokens exceeds the limit of {cfg.prompt_limit} "
                        f"tokens (max_model_len={cfg.max_model_len}, chunked_prefill={cfg.chunked_prefill}, "
                        f"max_num_batched_tokens={cfg.max_num_batched_tokens})"
                    ),
                )
                outputs.ignored_seqs.append(seq)
                continue
            # Sequences whose prompt completes join `running` at once; a chunked one will.
            if len(self.running) + len(self.prompted) + int(is_chunked) >= cfg.max_num_seqs:
                break
            # Prompt log-probs need every position's logits: such a prefill reuses no cached prefix.
            hits = bm.lookup_prefix(seq) if not seq.block_table and not seq.needs_prompt_logprobs else []
            computed = len(hits) * bm.block_size if hits else seq.num_computed_tokens
            remaining = seq.num_tokens - computed
            chunk = remaining
            if chunk > budget:
                if not cfg.chunked_prefill:
                    break
                chunk = budget
            if bm.num_blocks_needed(seq, hits, computed + chunk) > bm.num_free_blocks:
                break
            sm = self.state_manager
            if sm is not None and seq.state_id < 0:
                if not sm.can_allocate():
                    break
                seq.state_id = sm.allocate()
            if not seq.block_table:
                bm.num_prefix_queries += seq.num_tokens
            bm.allocate_prefill(seq, hits, computed + chunk)
            seq.num_cached_tokens = len(hits) * bm.block_size if hits else seq.num_cached_tokens
            seq.num_computed_tokens = computed + chunk
            bm.register_full_blocks(seq)
            budget -= chunk
            finished_prompt = chunk == remaining
            if finished_prompt:
                self.waiting.popleft()
                seq.num_pending_tokens += 1  # this step samples its next token
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            outputs.add(seq, chunk, do_sample=finished_prompt)
            if not finished_prompt:
                is_chunked = True
            if is_chunked and self.engine_type is EngineType.NORMAL:
                break  # NORMAL keeps the step short: the next one may be a decode step
        if self.engine_type is not EngineType.NORMAL or outputs.scheduled_seqs or outputs.ignored_seqs:
            return outputs
        return None  # NORMAL with nothing scheduled: _schedule_normal decides

    def _schedule_decode(self) -> SchedulerOutputs:
        cfg, bm = self.config, self.block_manager
        outputs = SchedulerOutputs(prompt_run=False)
        # Handed-over and forked sequences join first; a fork gets its own copy of the last,
        # partly written block (and of its state slot) before it writes there.
        while self.prompted and len(self.running) < cfg.max_num_seqs:
            seq, forked = self.prompted[0]
            if forked:
                index = seq.num_computed_tokens // bm.block_size
                # Its parent's last block: shared, or (zero-overhead scheduling) already filled
                # with the parent's token in the fork's slot and published, its parent gone.
                shared = index < len(seq.block_table) and bm.must_copy_before_write(seq.block_table[index])
                sm = self.state_manager if seq.state_id < 0 else None  # a state slot still to allocate
                if (shared and bm.num_free_blocks < 1) or (sm is not None and not sm.can_allocate()):
                    break
                copy = bm.copy_block(seq, index) if shared else None
                if copy is not None:
                    outputs.clone_blocks.append(copy)
                if sm is not None:
                    seq.state_id = sm.allocate()
                    if seq.state_source >= 0:
                        outputs.clone_states.append((seq.state_source, seq.state_id))
            self.prompted.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        # Decode in arrival order; when blocks run out, preempt the latest arrival (LCFS).
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.reached_max_tokens or seq.num_tokens >= cfg.max_model_len:
                continue  # finishes when its in-flight token lands; nothing more to compute
            if bm.blocks_for(seq.num_computed_tokens + 1) > bm.num_total_blocks:
                self._end_outgrown(seq, outputs)  # preempting could never make room
                continue
            self._schedule_decode_seq(seq, outputs)
        return outputs

    def _schedule_decode_seq(self, seq: Sequence, outputs: SchedulerOutputs) -> None:
        """One decode token for ``seq``, and its drafts when it speculates and blocks allow."""
        bm = self.block_manager
        drafts = self._drafts(seq)
        if drafts and not bm.can_append_slot(seq, 1 + len(drafts)):
            drafts = []  # no room for the drafts: a plain decode step, which may preempt
        while not bm.can_append_slot(seq):
            victim = self.running[-1]
            self._preempt(victim, outputs)
            if victim is seq:
                return
        num_tokens = 1 + len(drafts)
        outputs.clone_blocks.extend(bm.append_slot(seq, num_tokens))
        seq.num_computed_tokens += num_tokens  # the drafts' K/V too; rolled back if rejected
        seq.num_pending_tokens += 1
        seq.draft_token_ids = drafts
        bm.register_full_blocks(seq)  # known tokens only: drafts are never published
        outputs.add(seq, num_tokens, do_sample=True)

    def _drafts(self, seq: Sequence) -> list[int]:
        """The draft pool's proposal, short enough that every token it could emit (the drafts
        and the bonus token) stays within max_tokens and the context."""
        if self.draft_pool is None:
            return []
        if not self.draft_pool.drafts_at(len(self.running)):
            self.draft_pool.skip(seq)  # a hidden-state drafter keeps its cache current
            return []
        room = min(seq.max_tokens - seq.num_output_tokens, self.config.max_model_len - seq.num_tokens) - 1
        return self.draft_pool.propose(seq, room)

    def rollback_drafts(self, seq: Sequence) -> None:
        """After a verifying step: forget the K/V of rejected drafts (the tokens after the last
        emitted one) and free the blocks that held only them."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids) - 1)
        seq.draft_token_ids = []
        if seq.block_table:
            self.block_manager.trim(seq)

    def _end_outgrown(self, seq: Sequence, outputs: SchedulerOutputs) -> None:
        """A sequence longer than the whole cache (``admit`` keeps engines' requests from
        getting here) ends with "length", reported like a stopped preemption."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._free_state(seq)
        self._release_draft_slot(seq)
        seq.finish(SequenceStatus.FINISHED_LENGTH)
        outputs.preempted_seqs.append(seq)

    def _preempt(self, seq: Sequence, outputs: SchedulerOutputs) -> None:
        self.running.remove(seq)
        if self.config.stop_preempted_request:
            outputs.given_up.append((seq, list(seq.block_table)))
        self.block_manager.free(seq)
        self._free_state(seq)
        self._release_draft_slot(seq)
        self.num_preemptions += 1
        outputs.preempted_seqs.append(seq)
        if self.config.stop_preempted_request:
            seq.finish(SequenceStatus.FINISHED_PREEMPTED, error=PREEMPTED_ERROR)
            return
        # Recompute later: back to the front of the queue, its cached blocks may still hit.
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._put_back(seq)

    def _put_back(self, seq: Sequence) -> None:
        """To the front of ``waiting``, but behind the prompts whose prefill is under way (a
        chunked prompt holding blocks). Ahead of one, a sequence that cannot get its blocks
        while that prompt holds them would stall the queue for good; behind it, the prompt
        completes first (the cache holds any one prompt) and runs or ends."""
        ahead = 0
        for queued in self.waiting:
            if not (queued.block_table and queued.num_computed_tokens > 0):
                break
            ahead += 1
        self.waiting.insert(ahead, seq)

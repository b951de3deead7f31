"""Apply sampled tokens to sequences: stop checks, n > 1 forks, one ``RequestDelta`` per request.

The engine loop never detokenizes: it checks what token ids decide (EOS, ``stop_token_ids``,
``max_tokens``, the context length) and reports new token ids. Text and stop strings belong to
the client side (``output_tracker``), which asks the engine to stop a sequence when a stop
string completes (``LLMEngine.stop_seq``).
"""

from __future__ import annotations

from collections.abc import Callable

from pdinfer.core.outputs import SchedulerOutputs
from pdinfer.core.scheduler import Scheduler
from pdinfer.core.spec_decode import num_accepted
from pdinfer.engine.request import RequestState, fork_seed
from pdinfer.engine.speculative import observe_hidden
from pdinfer.engine.step_builder import InFlight
from pdinfer.outputs import PromptLogprobs, RequestDelta
from pdinfer.sequence import Sequence, SequenceStatus
from pdinfer.worker.step_input import StepResult


class OutputProcessor:
    """Given what it works on by its engine: the requests, the scheduler, and two callbacks,
    ``report`` (a request's delta, made and forgotten when finished) and ``forget_seq`` (an
    ended sequence's step-builder state)."""

    def __init__(
        self,
        requests: dict[str, RequestState],
        scheduler: Scheduler,
        max_model_len: int,
        first_tokens_only: bool,
        report: Callable[[RequestState], RequestDelta],
        forget_seq: Callable[[Sequence], None],
    ):
        self.requests, self.scheduler, self.max_model_len = requests, scheduler, max_model_len
        # A PE only samples first tokens for a CE: no stop checks, no forks (the CE does both).
        self.first_tokens_only = first_tokens_only
        self.report, self.forget_seq = report, forget_seq

    def abort(self, seq: Sequence) -> None:
        seq.finish(SequenceStatus.FINISHED_ABORTED)

    def scheduler_outputs(self, plan: SchedulerOutputs) -> list[RequestDelta]:
        """Deltas for sequences the scheduler itself ended (too long, preempted and stopped)."""
        touched: dict[str, RequestState] = {}
        for seq in plan.ignored_seqs + [s for s in plan.preempted_seqs if s.is_finished]:
            self.forget_seq(seq)  # ended without finalize_seq (its blocks are free)
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            if seq.num_output_tokens == 0 or seq.index == 0 and len(state.seqs) == 1:
                state.expected_seqs = len(state.seqs)  # no forks will come
            touched[state.request_id] = state
        return [self.report(state) for state in touched.values()]

    def process(self, inflight: InFlight, result: StepResult) -> list[RequestDelta]:
        touched: dict[str, RequestState] = {}
        plan = inflight.plan
        for seq, done in zip(plan.scheduled_seqs, plan.do_sample):
            if done:
                seq.num_pending_tokens -= 1
        if inflight.prompt_owners:
            self._add_prompt_logprobs(inflight.prompt_owners, result)
        requests = self.requests
        index, owners = 0, inflight.owners
        while index < len(owners):
            seq, copy = owners[index]
            drafts = inflight.drafts.get(seq.seq_id) if copy == 0 else None
            num_rows = 1 + len(drafts) if drafts else 1
            state = requests.get(seq.request_id)
            if drafts:
                if not seq.is_finished and state is not None:
                    self._verify_drafts(seq, drafts, result, index)
                    touched[state.request_id] = state
            elif state is None or seq.is_finished and not (copy > 0 and len(state.seqs) < state.expected_seqs):
                # Aborted or stopped while this step ran: its sample is dropped. A fork's first
                # token is not: output 0 may have ended on its own first token (max_tokens=1,
                # EOS, a stop string), and the other n - 1 outputs are still due.
                pass
            else:
                self._apply_token(state, seq, copy, result, index)
                touched[state.request_id] = state
            index += num_rows
        pool = self.scheduler.draft_pool
        if pool is not None and result.hidden is not None:
            observe_hidden(pool, inflight, result)  # the MTP drafter's input
        return [self.report(state) for state in touched.values()]

    def _apply_token(self, state: RequestState, seq: Sequence, copy: int, result: StepResult, index: int) -> None:
        token = result.token_ids[index]
        if self.first_tokens_only:
            self._record_first_token(state, seq, copy, token, result, index)
        elif copy > 0:
            fork = self._fork(state, seq, copy, token)
            self._add_logprobs(fork, result, index, token, replace=True)
            self._after_token(fork, token)
        else:
            seq.append_token(token)
            self._add_logprobs(seq, result, index, token)
            self._after_token(seq, token)

    def _verify_drafts(self, seq: Sequence, drafts: list[int], result: StepResult, index: int) -> None:
        """A speculating sequence's rows: emit the accepted drafts and the token after them
        (``spec_decode``), stopping exactly where a stop condition ends the output, then roll
        back the K/V of what was not emitted."""
        sampled = result.token_ids[index : index + len(drafts) + 1]
        accepted = num_accepted(drafts, sampled)
        for row, token in enumerate(sampled[: accepted + 1]):
            seq.append_token(token)
            self._add_logprobs(seq, result, index + row, token)
            self._after_token(seq, token)
            if seq.is_finished:
                break
        pool = self.scheduler.draft_pool
        if pool is not None:
            pool.record(seq, len(drafts), accepted)
        self.scheduler.rollback_drafts(seq)

    @staticmethod
    def _add_prompt_logprobs(prompt_owners: list[tuple[Sequence, int]], result: StepResult) -> None:
        """Append each sequence's rows of this step's prompt log-probs (a chunk's worth)."""
        assert result.prompt_logprobs is not None and result.prompt_ranks is not None
        row = 0
        for seq, num_rows in prompt_owners:
            end = row + num_rows
            k = seq.sampling_params.prompt_logprobs or 0
            top_ids, top_logprobs = result.prompt_top_ids, result.prompt_top_logprobs
            chunk = PromptLogprobs(
                result.prompt_logprobs[row:end],
                result.prompt_ranks[row:end],
                [ids[:k] for ids in top_ids[row:end]] if top_ids is not None else [[]] * num_rows,
                [lps[:k] for lps in top_logprobs[row:end]] if top_logprobs is not None else [[]] * num_rows,
            )
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = chunk
            else:
                seq.prompt_logprobs.extend(chunk)
            row = end

    def _record_first_token(self, state, seq, copy, token, result, index) -> None:
        if copy == 0:
            seq.append_token(token)
            self._add_logprobs(seq, result, index, token)
            seq.first_tokens = [token]
        else:
            seq.first_tokens.append(token)

    def accept_first_tokens(self, seq: Sequence, tokens: list[int], logprobs: dict[int, float] | None = None) -> None:
        """A CE takes over a sequence whose first token(s) a PE sampled: the same stop checks
        and (for n > 1) the same forks a NORMAL engine would have made."""
        state = self.requests[seq.request_id]
        for copy, token in enumerate(tokens):
            target = seq
            if copy == 0:
                seq.append_token(token)
            else:
                target = self._fork(state, seq, copy, token)
            if logprobs is not None and copy == 0 and seq.sampling_params.logprobs is not None:
                seq.output_logprobs.append(dict(logprobs))
                seq.cumulative_logprob += logprobs.get(token, 0.0)
            self._after_token(target, token)

    def _fork(self, state: RequestState, parent: Sequence, copy: int, token: int) -> Sequence:
        child = self.scheduler.fork_seq(
            parent, replace_last_token_id=token, index=copy, seed=fork_seed(parent.seed, copy)
        )
        child.num_cached_tokens = parent.num_cached_tokens
        if parent.grammar is not None:  # forks are made right after the prompt: a fresh matcher
            child.grammar = parent.grammar.fresh()
        state.seqs.append(child)
        return child

    def _add_logprobs(self, seq: Sequence, result: StepResult, index: int, token: int, replace: bool = False) -> None:
        if seq.sampling_params.logprobs is None or result.logprobs is None:
            return
        entry = {token: result.logprobs[index]}
        k = seq.sampling_params.logprobs
        if k and result.top_ids is not None and result.top_logprobs is not None:  # set together
            for tid, lp in zip(result.top_ids[index][:k], result.top_logprobs[index][:k]):
                entry.setdefault(tid, lp)
        if replace:  # a fork copied its parent's logprobs of the first token
            seq.output_logprobs = seq.output_logprobs[:-1]
            seq.cumulative_logprob = 0.0
        seq.output_logprobs.append(entry)
        seq.cumulative_logprob += result.logprobs[index]

    def _after_token(self, seq: Sequence, token: int) -> None:
        if seq.grammar is not None and not seq.grammar.accept(token):
            # The mask allowed it, so this is a bug, not the client's fault: end the output.
            seq.error = f"the structured-output grammar refused token {token}"
            seq.finish(SequenceStatus.FINISHED_ABORTED)
            self.scheduler.finish_seq(seq)
            return
        status = self._check_stop(seq, token)
        if status is None and seq.grammar is not None and seq.grammar.ended:
            status = SequenceStatus.FINISHED_STOPPED  # the match is complete
        if status is not None:
            seq.finish(status)
            self.scheduler.finish_seq(seq)

    def _check_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
        if token in seq.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        stop_ids = seq.sampling_params.stop_token_ids
        if stop_ids and token in stop_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        # Known tokens only: with zero-overhead scheduling a later token may already be in flight.
        if len(seq.token_ids) - seq.num_prompt_tokens >= seq.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if len(seq.token_ids) >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

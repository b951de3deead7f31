"""Apply sampled tokens to sequences: detokenize, check stop conditions, fork n > 1, report."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdinfer.core.outputs import SchedulerOutputs
from pdinfer.engine.detokenizer import Detokenizer, find_stop
from pdinfer.engine.request import RequestState, fork_seed
from pdinfer.outputs import RequestOutput
from pdinfer.sequence import Sequence, SequenceStatus
from pdinfer.worker.step_input import StepResult

if TYPE_CHECKING:
    from pdinfer.engine.llm_engine import InFlight, LLMEngine


class OutputProcessor:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.detokenizer = Detokenizer(engine.tokenizer)
        # A PE only samples first tokens for a CE: no stop checks, no forks (the CE does both).
        self.prefill_only = False

    def start(self, seq: Sequence, replay_output: bool = False) -> None:
        """Begin detokenizing ``seq``; ``replay_output`` first decodes the output tokens it
        already has (a sequence continued from another engine)."""
        skip = seq.sampling_params.skip_special_tokens
        seq.detok = self.detokenizer.start(seq.prompt_token_ids, skip)
        if replay_output:
            seq.output_text = "".join(self.detokenizer.append(seq.detok, t, skip) for t in seq.output_token_ids)

    def abort(self, seq: Sequence) -> None:
        seq.finish(SequenceStatus.FINISHED_ABORTED)

    def scheduler_outputs(self, plan: SchedulerOutputs) -> list[RequestOutput]:
        """Outputs for sequences the scheduler itself ended (too long, preempted and stopped)."""
        touched: dict[str, RequestState] = {}
        for seq in plan.ignored_seqs + [s for s in plan.preempted_seqs if s.is_finished]:
            state = self.engine.requests.get(seq.request_id)
            if state is None:
                continue
            if seq.num_output_tokens == 0 or seq.index == 0 and len(state.seqs) == 1:
                state.expected_seqs = len(state.seqs)  # no forks will come
            touched[state.request_id] = state
        return [self.engine._report(state) for state in touched.values()]

    def process(self, inflight: InFlight, result: StepResult) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {}
        plan = inflight.plan
        for seq, done in zip(plan.scheduled_seqs, plan.do_sample):
            if done:
                seq.num_pending_tokens -= 1
        for index, (seq, copy) in enumerate(inflight.owners):
            if seq.is_finished:
                continue  # aborted or stopped while this step ran; its sample is dropped
            state = self.engine.requests.get(seq.request_id)
            if state is None:
                continue
            token = result.token_ids[index]
            if self.prefill_only:
                self._record_first_token(state, seq, copy, token, result, index)
                touched[state.request_id] = state
                continue
            if copy > 0:
                seq = self._fork(state, seq, copy, token)
                self._add_logprobs(seq, result, index, token, replace=True)
            else:
                seq.append_token(token)
                self._add_logprobs(seq, result, index, token)
            self._after_token(state, seq, token)
            touched[state.request_id] = state
        return [self.engine._report(state) for state in touched.values()]

    def _record_first_token(self, state, seq, copy, token, result, index) -> None:
        if copy == 0:
            seq.append_token(token)
            self._add_logprobs(seq, result, index, token)
            seq.first_tokens = [token]
            if state.first_token_time is None:
                state.first_token_time = time.monotonic()
        else:
            seq.first_tokens.append(token)

    def accept_first_tokens(self, seq: Sequence, tokens: list[int], logprobs: dict[int, float] | None = None) -> None:
        """A CE takes over a sequence whose first token(s) a PE sampled: the same stop checks
        and (for n > 1) the same forks a NORMAL engine would have made."""
        state = self.engine.requests[seq.request_id]
        for copy, token in enumerate(tokens):
            target = seq
            if copy == 0:
                seq.append_token(token)
            else:
                target = self._fork(state, seq, copy, token)
            if logprobs is not None and copy == 0 and seq.sampling_params.logprobs is not None:
                seq.output_logprobs.append(dict(logprobs))
                seq.cumulative_logprob += logprobs.get(token, 0.0)
            self._after_token(state, target, token)

    def _fork(self, state: RequestState, parent: Sequence, copy: int, token: int) -> Sequence:
        child = self.engine.scheduler.fork_seq(
            parent, replace_last_token_id=token, index=copy, seed=fork_seed(parent.seed, copy)
        )
        child.detok = self.detokenizer.start(child.prompt_token_ids, child.sampling_params.skip_special_tokens)
        child.num_cached_tokens = parent.num_cached_tokens
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

    def _after_token(self, state: RequestState, seq: Sequence, token: int) -> None:
        if state.first_token_time is None:
            state.first_token_time = time.monotonic()
            seq.first_token_time = state.first_token_time
        params = seq.sampling_params
        new_text = self.detokenizer.append(seq.detok, token, params.skip_special_tokens)
        seq.output_text += new_text
        status = self._check_stop(seq, token, len(new_text))
        if status is not None:
            seq.finish(status)
            self.engine.scheduler.finish_seq(seq)

    def _check_stop(self, seq: Sequence, token: int, new_chars: int) -> SequenceStatus | None:
        params = seq.sampling_params
        if token in seq.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if params.stop_token_ids and token in params.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if params.stop_strings and new_chars:
            found = find_stop(seq.output_text, new_chars, params.stop_strings)
            if found is not None:
                index, stop = found
                end = index + len(stop) if params.include_stop_str_in_output else index
                seq.output_text = seq.output_text[:end]
                seq.stop_reason = stop
                return SequenceStatus.FINISHED_STOPPED
        # Known tokens only: with zero-overhead scheduling a later token may already be in flight.
        if len(seq.token_ids) - seq.num_prompt_tokens >= seq.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if len(seq.token_ids) >= self.engine.scheduler_config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

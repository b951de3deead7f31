"""Snapshot a scheduler plan into a ``StepInput`` (plain lists) for the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdinfer.core.outputs import SchedulerOutputs
from pdinfer.engine.request import fork_seed
from pdinfer.sequence import Sequence
from pdinfer.worker.executor import StepFuture
from pdinfer.worker.step_input import PENDING_TOKEN, SampleSpec, StepInput


@dataclass
class InFlight:
    """A launched step: its plan, its input, the sequences each sampled row belongs to, and
    the future of its result (the output processor reads it back)."""

    plan: SchedulerOutputs
    inp: StepInput
    owners: list[tuple[Sequence, int]]
    future: StepFuture
    prompt_owners: list[tuple[Sequence, int]]  # (sequence, its rows of prompt log-probs)
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> the drafts it verifies


class StepBuilder:
    """Also remembers which step sampled each sequence's newest token (for pending tokens)."""

    def __init__(self) -> None:
        self.next_step_id = 0
        self.last_sample: dict[int, tuple[int, int]] = {}  # seq_id -> (step id, sample index)

    def build(
        self, plan: SchedulerOutputs, defer_masks: bool = False
    ) -> tuple[StepInput, list[tuple[Sequence, int]], list[tuple[Sequence, int]]]:
        """The step input; for each sample the sequence it belongs to and which copy it is; and
        the sequences whose prompt log-probs the step computes, with their number of rows.
        ``defer_masks``: grammar masks are left to be filled in later (``SampleSpec.masked_later``)."""
        step_id = self.next_step_id
        self.next_step_id += 1
        inp = StepInput(
            step_id=step_id,
            is_prompt=plan.prompt_run,
            input_ids=[],
            positions=[],
            query_lens=[],
            context_lens=[],
            block_tables=[],
            clone_blocks=list(plan.clone_blocks),
            clone_states=list(plan.clone_states),
        )
        owners: list[tuple[Sequence, int]] = []
        prompt_owners: list[tuple[Sequence, int]] = []
        for seq, num_tokens, do_sample in zip(plan.scheduled_seqs, plan.num_scheduled_tokens, plan.do_sample):
            if plan.prompt_run and seq.needs_prompt_logprobs:
                self._add_prompt_rows(inp, prompt_owners, seq, num_tokens)
            self._add_seq(inp, owners, seq, num_tokens, do_sample, defer_masks)
        return inp, owners, prompt_owners

    @staticmethod
    def _add_prompt_rows(inp: StepInput, prompt_owners: list, seq: Sequence, num_tokens: int) -> None:
        """The rows of this chunk that score a prompt token: position p scores token p + 1.
        Computed in order from token 1; a chunk that does not continue them adds none."""
        end = seq.num_computed_tokens
        start = end - num_tokens
        done = seq.num_prompt_logprobs_scheduled
        last = min(end, seq.num_prompt_tokens - 1)  # the prompt's last row scores an output token
        if not start <= done < last:
            return
        first_row = len(inp.input_ids) + done - start
        inp.prompt_rows.extend(range(first_row, first_row + last - done))
        inp.prompt_targets.extend(seq.prompt_token_ids[done + 1 : last + 1])
        inp.prompt_top_k = max(inp.prompt_top_k, seq.sampling_params.prompt_logprobs or 0)
        prompt_owners.append((seq, last - done))
        seq.num_prompt_logprobs_scheduled = last

    def _add_seq(
        self, inp: StepInput, owners: list, seq: Sequence, num_tokens: int, do_sample: bool, defer_masks: bool
    ) -> None:
        end = seq.num_computed_tokens  # already advanced by the scheduler
        start = end - num_tokens
        first_row = len(inp.input_ids)
        pending_ref = None
        drafts = seq.draft_token_ids  # speculating: the last known token, then these
        known = min(end, len(seq.token_ids))
        if known > start:  # known tokens: whole slices (a prefill chunk is thousands of them)
            inp.input_ids.extend(seq.token_ids[start:known])
            inp.positions.extend(range(start, known))
        for pos in range(max(start, known), end):  # tokens not in token_ids yet
            if drafts:
                inp.input_ids.append(drafts[pos - len(seq.token_ids)])
            else:
                # Sampled by the step in flight; the runner reads it from that step's output.
                pending_ref = self.last_sample[seq.seq_id]
                inp.pending.append((len(inp.input_ids), *pending_ref))
                inp.input_ids.append(-1)
            inp.positions.append(pos)
        table = list(seq.block_table)
        if drafts:
            # A verifying step is a decode step: the sequence's 1 + k tokens are 1 + k rows of one
            # query each, sharing its block table, each attending up to its own position (a
            # step writes every row's K/V before any row attends). So the decode kernels (and
            # the CPU decode stack) run it, and each row's logits are a plain decode step's.
            for pos in range(start, end):
                inp.query_lens.append(1)
                inp.context_lens.append(pos + 1)
                inp.block_tables.append(table)
        else:
            inp.query_lens.append(num_tokens)
            inp.context_lens.append(end)
            inp.block_tables.append(table)
        if not do_sample:
            return
        if drafts:
            self._add_draft_samples(inp, owners, seq, first_row, start)
            return
        row = first_row + num_tokens - 1
        # n > 1: the prompt is computed once and sampled n times; outputs 1..n-1 become forks.
        copies = seq.sampling_params.n if (inp.is_prompt and seq.num_output_tokens == 1 and seq.index == 0) else 1
        self.last_sample[seq.seq_id] = (inp.step_id, len(inp.samples))
        for copy in range(copies):
            seed = fork_seed(seq.seed, copy)
            inp.samples.append(_sample_spec(seq, row, end, seed, pending_ref is not None, defer_masks))
            owners.append((seq, copy))

    def _add_draft_samples(self, inp: StepInput, owners: list, seq: Sequence, first_row: int, start: int) -> None:
        """Every row of a speculating sequence is sampled: row i samples the token at position
        start + i + 1 as a plain decode step there would (same seed and position; penalties see
        the drafts before it as output tokens)."""
        self.last_sample.pop(seq.seq_id, None)  # its next step follows this one's processing
        drafts = seq.draft_token_ids
        for i in range(len(drafts) + 1):
            spec = _sample_spec(seq, first_row + i, start + i + 1, seq.seed, False, False)
            if spec.output_tokens is not None:
                spec.output_tokens += drafts[:i]
            inp.samples.append(spec)
            owners.append((seq, 0))

    def forget(self, seq: Sequence) -> None:
        self.last_sample.pop(seq.seq_id, None)


def _min_tokens_bias(seq: Sequence, position: int) -> dict[int, float] | None:
    """``logit_bias`` with EOS and the stop tokens masked while fewer than ``min_tokens`` outputs
    precede the one sampled at ``position``."""
    p = seq.sampling_params
    if position - seq.num_prompt_tokens >= p.min_tokens:
        return p.logit_bias
    masked = dict.fromkeys((*seq.eos_token_ids, *(p.stop_token_ids or ())), float("-inf"))
    return {**(p.logit_bias or {}), **masked}


def _sample_spec(seq: Sequence, row: int, position: int, seed: int, pending: bool, defer_mask: bool) -> SampleSpec:
    p = seq.sampling_params
    spec = SampleSpec(
        row=row,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        seed=seed,
        position=position,
        presence=p.presence_penalty,
        frequency=p.frequency_penalty,
        repetition=p.repetition_penalty,
        logprobs=p.logprobs,
        logit_bias=_min_tokens_bias(seq, position) if p.min_tokens else p.logit_bias,
        allowed=seq.grammar.next_mask() if seq.grammar is not None and not defer_mask else None,
        masked_later=seq.grammar is not None and defer_mask,
    )
    if spec.needs_penalties:
        spec.output_tokens = list(seq.output_token_ids) + ([PENDING_TOKEN] if pending else [])
        spec.prompt_tokens = list(seq.prompt_token_ids)
    return spec

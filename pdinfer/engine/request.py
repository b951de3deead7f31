"""A request as the engine tracks it: its sequences and how to report them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdinfer.outputs import MIGRATE_PREEMPTED, PromptLogprobs, RequestDelta, Resume, SeqDelta
from pdinfer.sampling_params import SamplingParams
from pdinfer.sequence import Sequence, SequenceStatus


def fork_seed(seed: int, index: int) -> int:
    """The seed of output ``index`` of a request; output 0 uses the request's own seed."""
    if index == 0:
        return seed
    return (seed * 1_000_003 + index * 0x9E3779B1) & 0x7FFFFFFF


def resume_seq(seq: Sequence, resume: Resume, token_ids: list[int]) -> None:
    """Make ``seq`` the continuation of an output another engine started: its tokens so far
    are outputs already reported (never sent again), under the output's own seed and index,
    and a structured output's matcher has read them."""
    params = seq.sampling_params
    if params.n != 1:
        raise ValueError("a resumed request continues one output: n must be 1")
    if params.prompt_logprobs is not None:
        raise ValueError("a resumed request cannot ask for prompt_logprobs (its client has them)")
    if not 0 <= resume.index < 1 << 16:
        raise ValueError(f"resume.index must be in [0, 65536), got {resume.index}")
    if resume.num_shown_chars < 0:
        raise ValueError("resume.num_shown_chars must be >= 0")
    if len(token_ids) >= seq.max_tokens:
        raise ValueError(f"resume has {len(token_ids)} tokens: nothing is left of max_tokens ({seq.max_tokens})")
    seq.index, seq.seed = resume.index, fork_seed(seq.seed, resume.index)
    seq.token_ids += token_ids
    seq.num_resumed_tokens = seq.num_reported_tokens = len(token_ids)
    if params.logprobs is not None:  # placeholders: the client has these tokens' log-probs
        seq.output_logprobs = [{} for _ in token_ids]
    if seq.grammar is not None and not all(seq.grammar.accept(token) for token in token_ids):
        raise ValueError("the resumed tokens do not match the request's structured output")


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    error: str | None = None
    # n, until the request ends before its prompt was computed (then no forks will come)
    expected_seqs: int = 0
    migrate: str | None = None  # ended to continue elsewhere (``outputs.MIGRATE_REASONS``)

    def __post_init__(self) -> None:
        self.expected_seqs = self.expected_seqs or self.sampling_params.n

    @property
    def finished(self) -> bool:
        return len(self.seqs) >= self.expected_seqs and all(s.is_finished for s in self.seqs)

    def make_delta(self) -> RequestDelta:
        """Every sequence's news since the last delta (nothing is ever sent twice)."""
        seqs = []
        for seq in self.seqs:
            new_tokens = seq.token_ids[seq.num_prompt_tokens + seq.num_reported_tokens :]
            finishing = seq.is_finished and not seq.reported_finished
            if not new_tokens and not finishing:
                continue
            logprobs = None
            if seq.sampling_params.logprobs is not None:
                start = seq.num_reported_tokens
                logprobs = seq.output_logprobs[start : start + len(new_tokens)]
            seq.num_reported_tokens += len(new_tokens)
            seq.reported_finished = seq.is_finished
            seqs.append(
                SeqDelta(
                    seq.index,
                    new_tokens,
                    logprobs,
                    seq.cumulative_logprob if logprobs is not None else None,
                    seq.finish_reason,
                    seq.stop_reason if isinstance(seq.stop_reason, int) else None,
                )
            )
        error = self.error or next((s.error for s in self.seqs if s.error), None)
        cached = self.seqs[0].num_cached_tokens if self.seqs else 0
        finished = self.finished
        migrate = self._migrate_reason() if finished else None
        return RequestDelta(self.request_id, seqs, finished, error, cached, self._prompt_logprobs(), migrate)

    def _migrate_reason(self) -> str | None:
        """Why another engine should continue this ended request, if it should: it was drained
        away, or an output was preempted on an engine that cannot recompute (a CE)."""
        if self.migrate is not None:
            return self.migrate
        if any(seq.status is SequenceStatus.FINISHED_PREEMPTED for seq in self.seqs):
            return MIGRATE_PREEMPTED
        return None

    def _prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt's log-probs, once: in the delta that carries its first sampled token."""
        first = self.seqs[0] if self.seqs else None
        if first is None or first.reported_prompt_logprobs or self.sampling_params.prompt_logprobs is None:
            return None
        if len(first.token_ids) <= first.num_prompt_tokens or not first.has_prompt_logprobs:
            return None  # the prompt is not computed yet (or, a fork's, never by this engine)
        first.reported_prompt_logprobs = True
        return first.prompt_logprobs or PromptLogprobs()  # a one-token prompt has none

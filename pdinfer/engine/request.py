"""A request as the engine tracks it: its sequences and how to report them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdinfer.engine.detokenizer import visible_text
from pdinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pdinfer.sampling_params import SamplingParams
from pdinfer.sequence import Sequence


def fork_seed(seed: int, index: int) -> int:
    """The seed of output ``index`` of a request; output 0 uses the request's own seed."""
    if index == 0:
        return seed
    return (seed * 1_000_003 + index * 0x9E3779B1) & 0x7FFFFFFF


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    error: str | None = None
    # n, until the request ends before its prompt was computed (then no forks will come)
    expected_seqs: int = 0

    def __post_init__(self) -> None:
        self.expected_seqs = self.expected_seqs or self.sampling_params.n

    @property
    def finished(self) -> bool:
        return len(self.seqs) >= self.expected_seqs and all(s.is_finished for s in self.seqs)

    def make_output(self) -> RequestOutput:
        finished = self.finished
        outputs = []
        for seq in sorted(self.seqs, key=lambda s: s.index):
            params = seq.sampling_params
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=visible_text(seq.output_text, params.stop_strings, seq.is_finished),
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
                    logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        error = self.error or next((s.error for s in self.seqs if s.error), None)
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finished_time=time.monotonic() if finished else None,
            num_cached_tokens=self.seqs[0].num_cached_tokens if self.seqs else 0,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            error=error,
            metrics=metrics,
        )

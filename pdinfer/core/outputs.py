"""The plan a scheduling step returns. The worker reads it and never touches scheduler state."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdinfer.sequence import Sequence


@dataclass
class SchedulerOutputs:
    prompt_run: bool
    scheduled_seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)  # query tokens per sequence
    do_sample: list[bool] = field(default_factory=list)  # False for a prompt chunk short of the end
    ignored_seqs: list[Sequence] = field(default_factory=list)
    preempted_seqs: list[Sequence] = field(default_factory=list)
    # Stopped preemptions (stop_preempted_request): each with the blocks it held, freed in this
    # plan but not yet written by it, so the KV store may still copy them (request migration).
    given_up: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    finished_seqs: list[Sequence] = field(default_factory=list)  # to finalize this step
    clone_blocks: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before forward
    clone_states: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) state slots

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_seqs

    def add(self, seq: Sequence, num_tokens: int, do_sample: bool) -> None:
        self.scheduled_seqs.append(seq)
        self.num_scheduled_tokens.append(num_tokens)
        self.do_sample.append(do_sample)

    @property
    def step_type(self) -> str:
        return "prefill" if self.prompt_run else "decode"

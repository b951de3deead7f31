"""A P/D job as the router keeps it: one prompt of a client request, and what its CEs sent.

The record is what request migration carries on from (``router_pd``, ``docs/kv-transfer.md``):
every token and character relayed, per output, so that a new attempt after a CE gave the job up
resumes each unfinished output from what its client has (``outputs.Resume``), never twice and
never with a gap.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from pdinfer.outputs import PromptLogprobs, Resume
from pdinfer.sampling_params import SEED_BITS
from pdinfer.serving.pd_protocol import OutputDelta

# The finish reasons of a CE that gave an output up (preempted, or aborted by a drain): the
# output goes on elsewhere, so they never reach the client.
GIVEN_UP = ("error", "abort")


@dataclass
class Progress:
    """What the job's CEs sent of one output: the state a migration carries on from."""

    token_ids: list[int] = field(default_factory=list)
    num_chars: int = 0  # text characters relayed
    finish_reason: str | None = None  # a real end ("stop", "length"), never a CE's give-up


@dataclass
class PDJob:
    """One prompt of a client request. The driver puts ``(index, kind, payload)`` on ``queue``:
    ("outputs", [OutputDelta]), ("done", None) or ("error", APIError)."""

    index: int
    request_id: str
    token_ids: list[int]
    sampling: dict
    queue: asyncio.Queue
    # A whole (non-streamed) answer: outputs wait here until the job finished.
    whole: bool = False
    arrival_s: float = field(default_factory=time.monotonic)
    attempt: int = 0
    first_token_s: float | None = None
    num_tokens: int = 0  # the longest choice so far, in this attempt
    prompt_logprobs: PromptLogprobs | None = None  # from the PE, before any output is delivered
    unsent: list[list[OutputDelta]] = field(default_factory=list)
    progress: dict[int, Progress] = field(default_factory=dict)  # output index -> what it has
    resume: Resume | None = None  # what this attempt continues (None: a fresh start)
    given_up_s: float | None = None  # when a CE last gave the job up (migration latency)

    def __post_init__(self) -> None:
        # A seed fixed here: a resumed output draws from the same random stream (the sampler
        # keys it by seed and position), seeded by the client or not. Per job, so that equal
        # unseeded prompts of one request still differ.
        if self.sampling.get("seed") is None:
            self.sampling = {**self.sampling, "seed": random.getrandbits(SEED_BITS)}

    @property
    def n(self) -> int:
        return self.sampling.get("n") or 1

    @property
    def has_tokens(self) -> bool:
        return any(p.token_ids for p in self.progress.values())

    @property
    def num_job_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.progress.values())

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.resume is None and self.sampling.get("prompt_logprobs") is not None

    def next_resume(self) -> Resume | None:
        """The output the next attempt continues; None for a fresh start (no tokens yet)."""
        if not self.has_tokens:
            return None
        for index in range(self.n):
            done = self.progress.get(index, Progress())
            if done.finish_reason is None:
                return Resume(list(done.token_ids), index, done.num_chars)
        return None

    @property
    def done(self) -> bool:
        return self.has_tokens and all(
            self.progress.get(i, Progress()).finish_reason is not None for i in range(self.n)
        )

    def body(self) -> dict:
        """This attempt's request to the engines."""
        body: dict = {"request_id": f"{self.request_id}-a{self.attempt}", "prompt_token_ids": self.token_ids}
        if self.resume is None:
            body["sampling"] = self.sampling
        else:  # one output, on from its tokens; the client has the prompt's log-probs
            body["sampling"] = {**self.sampling, "n": 1, "prompt_logprobs": None}
            body["resume"] = {
                "token_ids": self.resume.token_ids,
                "index": self.resume.index,
                "num_shown_chars": self.resume.num_shown_chars,
            }
        return body

    def deliver(self, outputs: list[OutputDelta]) -> None:
        for delta in outputs:
            done = self.progress.setdefault(delta.index, Progress())
            done.token_ids += delta.token_ids
            done.num_chars += len(delta.text)
            if delta.finish_reason is not None:
                done.finish_reason = delta.finish_reason
        if self.whole:
            self.unsent.append(outputs)
            return
        self.queue.put_nowait((self.index, "outputs", outputs))

    def start_attempt(self) -> None:
        self.attempt += 1
        self.num_tokens = 0
        self.resume = self.next_resume()

    def finish(self) -> None:
        for outputs in self.unsent:
            self.queue.put_nowait((self.index, "outputs", outputs))
        self.unsent = []
        self.queue.put_nowait((self.index, "done", None))


def without_give_up(delta: OutputDelta) -> OutputDelta:
    return OutputDelta(delta.index, delta.text, delta.token_ids, None, delta.logprobs)

"""The client side of a request: engine deltas in, text and user-facing outputs out.

An engine loop reports new token ids (``RequestDelta``); the ``OutputTracker`` of the request,
wherever the client runs (the API-server process, the DP front, ``LLMEngine.step`` in process),
detokenizes them incrementally, applies stop strings and keeps the cumulative state. When a stop
string completes, ``apply`` says which outputs stopped, and the caller tells the engine
(``stop_seq``) so it stops computing them; tokens the engine produced past that point are
dropped here, so the output is the same as if the engine had checked the string itself.

While an output runs with stop strings, its visible text holds back the last
``len(longest stop) - 1`` characters, so a stream never shows the start of a stop string that
later completes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdinfer.engine.detokenizer import Detokenizer, DetokState, find_stop
from pdinfer.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
    Resume,
    SeqDelta,
)
from pdinfer.sampling_params import SamplingParams


@dataclass
class ChoiceDelta:
    """What one output gained since the last one shown."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    text_offset: int  # characters of this output before ``text``
    stop_reason: int | str | None = None


class _Choice:
    __slots__ = (
        "index",
        "detok",
        "text",
        "token_ids",
        "logprobs",
        "cumulative_logprob",
        "finish_reason",
        "stop_reason",
        "num_shown_chars",
        "num_shown_tokens",
        "finish_shown",
    )

    def __init__(self, index: int, detok: DetokState, want_logprobs: bool):
        self.index = index
        self.detok = detok
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_shown_chars = 0
        self.num_shown_tokens = 0
        self.finish_shown = False  # its last delta went out: nothing more is shown of it


class OutputTracker:
    """One request's outputs as the client sees them.

    ``show_token_ids``: every new token is worth a delta even without new text (a client that
    asked for token ids or log-probs); otherwise a token that completes no character (half of a
    multi-byte one) waits for the next. ``apply_stops=False`` leaves stop strings to another
    engine (a PE's first token: the CE that continues the request applies them).
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: Detokenizer,
        show_token_ids: bool = False,
        arrival_time: float | None = None,
        apply_stops: bool = True,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = detokenizer
        self.show_token_ids = show_token_ids or params.logprobs is not None
        self.choices: dict[int, _Choice] = {}
        self.engine_finished = False
        self._finished = False
        self.error: str | None = None
        self.migrate: str | None = None  # the engine ended it to be continued elsewhere (why)
        self.num_cached_tokens = 0
        self.prompt_logprobs: PromptLogprobs | None = None  # once the engine computed the prompt
        self._prompt_dicts: list[dict[int, float] | None] | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self._stops = params.stop_strings if apply_stops else ()
        self._hold = max(len(s) for s in self._stops) - 1 if self._stops else 0

    @property
    def finished(self) -> bool:
        """The engine ended the request, or every output has ended (a stop string, here)."""
        return self._finished

    def _update_finished(self) -> None:
        # Outputs end only in ``apply`` and ``fail``, so they recompute this; reading it (several
        # times a step for every request) stays a field access.
        self._finished = self.engine_finished or (
            len(self.choices) >= self.params.n and all(c.finish_reason for c in self.choices.values())
        )

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    def apply(self, delta: RequestDelta) -> list[int]:
        """Take one engine delta; return the indices of the outputs a stop string ended."""
        if self.finished:
            return []
        stopped = []
        for seq in delta.seqs:
            choice = self.choices.get(seq.index)
            if choice is None:
                detok = self.detokenizer.start(self.prompt_token_ids, self.params.skip_special_tokens)
                choice = self.choices[seq.index] = _Choice(seq.index, detok, self.params.logprobs is not None)
            if choice.finish_reason is not None:
                continue  # stopped here already; the engine's late tokens are dropped
            if self._take(choice, seq):
                stopped.append(seq.index)
        if delta.num_cached_tokens:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.engine_finished = True
            self.error, self.migrate = delta.error, delta.migrate
        if self.first_token_time is None and self.num_output_tokens:
            self.first_token_time = time.monotonic()
        self._update_finished()
        if self.finished and self.finished_time is None:
            self.finished_time = time.monotonic()
        return stopped

    def resume(self, resume: Resume) -> None:
        """Continue an output whose first tokens another engine made (request migration): its
        text is rebuilt from them, so a stop string that spans the move is still found and
        the next text is cut where the first engine would have cut it; what the client has
        seen (``num_shown_chars``) is not shown again, what was held back is."""
        params = self.params
        detok = self.detokenizer.start(self.prompt_token_ids, params.skip_special_tokens)
        choice = self.choices[resume.index] = _Choice(resume.index, detok, params.logprobs is not None)
        for token in resume.token_ids:
            choice.text += self.detokenizer.append(detok, token, params.skip_special_tokens)
        choice.token_ids = list(resume.token_ids)
        if choice.logprobs is not None:
            choice.logprobs = [{} for _ in resume.token_ids]  # placeholders: the client has them
        choice.num_shown_tokens = len(resume.token_ids)
        choice.num_shown_chars = min(resume.num_shown_chars, len(choice.text))

    def take_shown(self) -> list[ChoiceDelta]:
        """What every output gained since the last call that may be shown now (several engine
        deltas applied in between come out as one)."""
        shown = [self._shown(c) for c in self.choices.values()]
        return [d for d in shown if d is not None]

    def _take(self, choice: _Choice, seq: SeqDelta) -> bool:
        """Append the delta's tokens; True if a stop string ended the output."""
        params = self.params
        stops, skip = self._stops, params.skip_special_tokens
        for i, token in enumerate(seq.token_ids):
            piece = self.detokenizer.append(choice.detok, token, skip)
            choice.token_ids.append(token)
            if choice.logprobs is not None and seq.logprobs is not None and i < len(seq.logprobs):
                choice.logprobs.append(seq.logprobs[i])
            choice.text += piece
            if stops and piece and len(choice.token_ids) > params.min_tokens:
                found = find_stop(choice.text, len(piece), stops)
                if found is not None:
                    index, stop = found
                    end = index + len(stop) if params.include_stop_str_in_output else index
                    choice.text = choice.text[:end]
                    choice.finish_reason, choice.stop_reason = "stop", stop
                    choice.cumulative_logprob = _kept_logprob(seq, i)
                    return True
        if seq.cumulative_logprob is not None:
            choice.cumulative_logprob = seq.cumulative_logprob
        if seq.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = seq.finish_reason, seq.stop_reason
        return False

    def _shown(self, choice: _Choice) -> ChoiceDelta | None:
        """What of ``choice`` is new and may be shown now; None if nothing is. An output's finish
        is shown once, though its siblings (n > 1) run on."""
        if choice.finish_shown:
            return None
        end = len(choice.text)
        if choice.finish_reason is None and self._hold:
            end = max(choice.num_shown_chars, end - self._hold)
        text = choice.text[choice.num_shown_chars : end]
        new_ids = choice.token_ids[choice.num_shown_tokens :]
        if not (text or choice.finish_reason or (new_ids and self.show_token_ids)):
            return None
        logprobs = choice.logprobs[choice.num_shown_tokens :] if choice.logprobs is not None else None
        out = ChoiceDelta(
            choice.index, text, new_ids, logprobs, choice.finish_reason, choice.num_shown_chars, choice.stop_reason
        )
        choice.num_shown_chars, choice.num_shown_tokens = end, len(choice.token_ids)
        choice.finish_shown = choice.finish_reason is not None
        return out

    def fail(self, error: str) -> None:
        """End every unfinished output with finish_reason "error" (the engine went away)."""
        self.engine_finished, self.error = True, error
        for i in range(self.params.n):
            self.choices.setdefault(i, _Choice(i, DetokState([], 0, 0), self.params.logprobs is not None))
        for choice in self.choices.values():
            if choice.finish_reason is None:
                choice.finish_reason = "error"
        self._update_finished()
        if self.finished_time is None:
            self.finished_time = time.monotonic()

    def output(self) -> RequestOutput:
        """The cumulative output (copies: later deltas do not change it)."""
        finished = self.finished
        outputs = [
            CompletionOutput(
                index=c.index,
                text=c.text,
                token_ids=list(c.token_ids),
                cumulative_logprob=c.cumulative_logprob,
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in sorted(self.choices.values(), key=lambda c: c.index)
        ]
        if not finished and self._hold:
            for out, c in zip(outputs, sorted(self.choices.values(), key=lambda c: c.index)):
                if c.finish_reason is None:
                    out.text = out.text[: max(0, len(out.text) - self._hold)]
        metrics = RequestMetrics(self.arrival_time, self.first_token_time, self.finished_time, self.num_cached_tokens)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            error=self.error,
            metrics=metrics,
            prompt_logprobs=self._prompt_logprob_dicts(),
        )

    def _prompt_logprob_dicts(self) -> list[dict[int, float] | None] | None:
        """``RequestOutput.prompt_logprobs``, built once (they never change once here)."""
        if self.prompt_logprobs is None:
            return None
        if self._prompt_dicts is None:
            self._prompt_dicts = self.prompt_logprobs.as_dicts(self.prompt_token_ids)
        return self._prompt_dicts


def _kept_logprob(seq: SeqDelta, last: int) -> float | None:
    """The cumulative log-prob up to token ``last`` of ``seq`` (tokens after it are dropped)."""
    if seq.cumulative_logprob is None or seq.logprobs is None:
        return None
    dropped = sum(entry.get(t, 0.0) for t, entry in zip(seq.token_ids[last + 1 :], seq.logprobs[last + 1 :]))
    return seq.cumulative_logprob - dropped

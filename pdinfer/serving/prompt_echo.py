"""The prompt's part of an answer: vLLM's ``prompt_logprobs`` and the legacy ``echo``.

- ``prompt_logprobs`` (vLLM's extra field, both endpoints, not with ``stream``): a list with
  ``None`` for the first prompt token, then one ``{token id (a string in JSON): {"logprob",
  "rank", "decoded_token"}}`` per prompt token: the token itself first, then the top k. On
  /v1/completions each choice carries it; on /v1/chat/completions the response does (vLLM's
  places).
- ``echo`` (/v1/completions): each choice's text starts with the prompt (the text sent, or the
  decoded token ids); with ``logprobs`` its legacy log-probs start with the prompt tokens' (the
  first one's ``null``). Streamed, the prompt goes in each choice's first chunk. ``max_tokens``
  0 with ``echo`` scores the prompt: the engine samples one token, which is not shown (text,
  tokens, log-probs, usage), and the finish reason is "length".

``PromptEcho`` is the one object ``ResponseFormat`` asks; ``None`` when a request asks for
neither, so the common answer costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from pdinfer.outputs import PromptLogprobs
from pdinfer.serving import protocol
from pdinfer.serving.logprobs import completion_logprobs

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM and OpenAI send this instead


class PromptSource(Protocol):
    """One prompt as the answer shows it (``OutputTracker`` is one)."""

    @property
    def prompt(self) -> str | None: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def prompt_logprobs(self) -> PromptLogprobs | None: ...  # once the engine computed the prompt


def prompt_logprobs_json(tokenizer, token_ids: list[int], plp: PromptLogprobs, k: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of one prompt, with the top ``k`` entries per token."""
    decode = _decoder(tokenizer)
    out: list[dict | None] = [None]
    for i, logprob in enumerate(plp.token_logprobs):
        token_id = token_ids[i + 1]
        entry = {str(token_id): _logprob(logprob, plp.ranks[i], decode(token_id))}
        for rank, (top_id, top) in enumerate(zip(plp.top_ids[i][:k], plp.top_logprobs[i][:k]), start=1):
            entry.setdefault(str(top_id), _logprob(top, rank, decode(top_id)))
        out.append(entry)
    return out


def _logprob(value: float, rank: int, text: str) -> dict:
    return {"logprob": max(value, _MIN_LOGPROB), "rank": rank, "decoded_token": text}


def _decoder(tokenizer) -> Callable[[int], str]:
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = tokenizer.decode([token_id])
        return text

    return decode


class PromptEcho:
    """What ``ResponseFormat`` adds for ``echo`` and ``prompt_logprobs``. ``sources[i]`` is
    prompt i of the request; choice ``c`` belongs to prompt ``c // n``."""

    def __init__(
        self,
        tokenizer,
        n: int,
        sources: Sequence[PromptSource],
        echo: bool,
        prompt_logprobs: int | None,
        num_logprobs: int | None,
        scoring_only: bool,
    ):
        self.tokenizer = tokenizer
        self.n = n
        self.sources = sources
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs
        self.num_logprobs = num_logprobs
        self.scoring_only = scoring_only
        self._shown: set[int] = set()  # choices whose prompt part went out
        self._texts: dict[int, str] = {}

    @classmethod
    def of(cls, body, tokenizer, sources: Sequence[PromptSource], num_logprobs: int | None) -> PromptEcho | None:
        """The echo of a request ``body``; None when it asks for neither."""
        echo = bool(getattr(body, "echo", False))
        if not echo and body.prompt_logprobs is None:
            return None
        scoring_only = bool(getattr(body, "scoring_only", False))
        return cls(tokenizer, body.n, sources, echo, body.prompt_logprobs, num_logprobs, scoring_only)

    def usage(self, usage: dict) -> dict:
        if not self.scoring_only:
            return usage
        return protocol.usage(usage["prompt_tokens"], 0)

    def chat_body(self, body: dict) -> None:
        """vLLM puts a chat answer's prompt log-probs on the response."""
        if self.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(0)

    def completion_choice(self, choice: dict) -> None:
        """Complete one completion choice: a whole one, or a stream chunk (the first gets the prompt)."""
        index = choice["index"]
        first = index not in self._shown
        self._shown.add(index)
        if self.scoring_only:  # the sampled token is not part of the answer
            choice["text"], choice["finish_reason"] = "", choice["finish_reason"] and "length"
            if "token_ids" in choice:
                choice["token_ids"] = []
            if choice["logprobs"] is not None:
                choice["logprobs"] = completion_logprobs(self.tokenizer, [], [], 0, 0)
        if self.echo:
            self._echo(choice, index // self.n, first)
        if self.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = self._prompt_logprobs(index // self.n)

    def _echo(self, choice: dict, prompt: int, first: bool) -> None:
        text = self._text(prompt)
        logprobs = choice["logprobs"]
        if logprobs is not None:  # the output's characters come after the prompt's
            logprobs["text_offset"] = [offset + len(text) for offset in logprobs["text_offset"]]
        if not first:
            return
        choice["text"] = text + choice["text"]
        if logprobs is not None:
            head = self._echo_logprobs(prompt)
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                logprobs[key] = head[key] + logprobs[key]

    def _echo_logprobs(self, prompt: int) -> dict:
        """The legacy log-probs of the prompt tokens: the first has none (``null``)."""
        source = self.sources[prompt]
        ids, plp = source.prompt_token_ids, source.prompt_logprobs
        k = self.num_logprobs or 0
        entries = [e for e in (plp or PromptLogprobs()).as_dicts(ids, top_k=k) if e is not None]  # all but the first
        head = completion_logprobs(self.tokenizer, ids[1:], entries, k, 0)
        first = self.tokenizer.decode([ids[0]])
        head["tokens"].insert(0, first)
        head["token_logprobs"].insert(0, None)
        head["top_logprobs"].insert(0, None)
        head["text_offset"] = [0] + [offset + len(first) for offset in head["text_offset"]]
        return head

    def _text(self, prompt: int) -> str:
        text = self._texts.get(prompt)
        if text is None:
            source = self.sources[prompt]
            text = source.prompt if source.prompt is not None else self.tokenizer.decode(source.prompt_token_ids)
            self._texts[prompt] = text
        return text

    def _prompt_logprobs(self, prompt: int) -> list[dict | None] | None:
        source = self.sources[prompt]
        if source.prompt_logprobs is None or self.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(
            self.tokenizer, source.prompt_token_ids, source.prompt_logprobs, self.prompt_logprobs
        )

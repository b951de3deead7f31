"""Incremental detokenization and stop-string handling.

Text is emitted only once it decodes to complete characters (a multi-byte character split over
tokens is never cut). A stop string is found even when it spans several tokens; the output text
ends right before it (or after it, with ``include_stop_str_in_output``). While a sequence runs,
the visible text holds back the last ``len(longest stop) - 1`` characters, so a stream never
shows the start of a stop string that later completes.
"""

from __future__ import annotations

from dataclasses import dataclass

_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first output (word spacing)


@dataclass
class DetokState:
    tokens: list[str]
    prefix_offset: int
    read_offset: int


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # transformers rebuilds ``all_special_ids`` on every ``convert_ids_to_tokens(...,
        # skip_special_tokens=True)`` call: at 256 sequences that was the largest host cost of an
        # offline decode step. The set is fixed per tokenizer, so it is read once here.
        self._special = frozenset(tokenizer.all_special_ids) if tokenizer is not None else frozenset()

    def _tokens(self, ids: list[int], skip_special_tokens: bool) -> list[str]:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special]
        return self.tokenizer.convert_ids_to_tokens(ids)

    def start(self, prompt_token_ids: list[int], skip_special_tokens: bool) -> DetokState:
        if self.tokenizer is None:
            return DetokState([], 0, 0)
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        tokens = self._tokens(context, skip_special_tokens)
        return DetokState(list(tokens), 0, len(tokens))

    def append(self, state: DetokState, token_id: int, skip_special_tokens: bool) -> str:
        """Add one token; return the text that became final."""
        if self.tokenizer is None:
            return ""
        if skip_special_tokens and token_id in self._special:
            return ""  # nothing to add: the text so far is already final
        state.tokens.append(self.tokenizer.convert_ids_to_tokens(token_id))
        convert = self.tokenizer.convert_tokens_to_string
        prefix = convert(state.tokens[state.prefix_offset : state.read_offset])
        full = convert(state.tokens[state.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            state.prefix_offset = state.read_offset
            state.read_offset = len(state.tokens)
            return full[len(prefix) :]
        return ""


def find_stop(text: str, new_chars: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last ``new_chars`` characters of ``text``."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def visible_text(text: str, stops: tuple[str, ...], finished: bool) -> str:
    if finished or not stops:
        return text
    hold = max(len(s) for s in stops) - 1
    return text[: len(text) - hold] if hold > 0 else text

"""Log-probs as OpenAI's two shapes show them: the legacy completions lists (tokens,
token_logprobs, top_logprobs, text_offset) and chat's content items (token, logprob, bytes,
top_logprobs). A token is shown by its text, or, when it holds part of a character, by its
bytes (``token_piece``)."""

from __future__ import annotations

from typing import Any


def top_entries(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of one position (at least the sampled one when k is 0)."""
    return sorted(entry.items(), key=lambda item: -item[1])[: max(k, 1)]


def completion_logprobs(
    tokenizer, token_ids: list[int], entries: list[dict[int, float]], k: int, text_offset: int
) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, raws = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text, raw = token_piece(tokenizer, token_id)
        tokens.append(text)
        raws.append(raw)
        token_logprobs.append(entry.get(token_id))
        tops.append({token_piece(tokenizer, t)[0]: lp for t, lp in top_entries(entry, k)})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": text_offsets(raws, text_offset),
    }


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]], k: int) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = token_piece(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    content = []
    for token_id, entry in zip(token_ids, entries):
        one = item(token_id, entry.get(token_id, float("-inf")))
        one["top_logprobs"] = [item(t, lp) for t, lp in top_entries(entry, k)] if k else []
        content.append(one)
    return {"content": content}


def token_piece(tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token as log-probs show it: (its text, its bytes). A token that holds part of a
    character (an emoji over two tokens) has bytes that are no text alone; it shows them as
    OpenAI does, ``bytes:\\xf0\\x9f``, and its ``bytes`` are the real ones, so that a client
    joining them gets the answer's UTF-8."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text, text.encode()
    raw = _raw_bytes(tokenizer.convert_ids_to_tokens(token_id))
    if raw is None:
        return text, text.encode()
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def _raw_bytes(piece: Any) -> bytes | None:
    """The bytes behind a vocabulary entry: a byte-fallback token (``<0xF0>``) or a byte-level
    BPE one (GPT-2's alphabet, one character a byte); None for anything else."""
    if not isinstance(piece, str) or not piece:
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    try:
        return bytes(_BYTE_LEVEL[c] for c in piece)
    except KeyError:
        return None


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + i)) for i, b in enumerate(shifted))
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


def text_offsets(pieces: list[bytes], start: int) -> list[int]:
    """Where each token begins in the text, in characters: the character its first byte is
    part of (a token that continues a character gets that character's offset). ``pieces`` may
    begin inside a character whose first bytes an earlier stream chunk held; the text this
    chunk shows begins with that character."""
    offsets, begun, at = [], 0, 0
    for raw in pieces:
        inside = bool(raw) and _continues(raw[0]) and begun > 0
        offsets.append(start + begun - inside)
        for byte in raw:
            if not _continues(byte) or at == 0:
                begun += 1  # a character begins here (or, at the very start, began earlier)
            at += 1
    return offsets


def _continues(byte: int) -> bool:
    return 0x80 <= byte < 0xC0

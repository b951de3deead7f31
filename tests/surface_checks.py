"""OpenAI-surface checks run the same against `serve` (test_api_server.py) and through the P/D
router (test_router.py): vLLM's ``return_token_ids`` with the prompt's ids,
``stream_options.continuous_usage_stats``, vLLM's ``min_tokens`` and ``guided_*`` names, and the
bytes and offsets of log-probs for tokens that hold part of a character. The reference for
prompt ids is the tokenizer in this process (and the chat template, for chat)."""

from __future__ import annotations

import json
import re

import openai
from conftest import CHAT, MODEL


def check_prompt_token_ids(client: openai.OpenAI, tokenizer) -> None:
    """Completions: each choice lists its own prompt's ids (a batch of two prompts, n = 2);
    streamed, only each choice's first chunk does. Chat: the response lists them once."""
    prompts = ["The capital of France is", "Once upon a time, in a land far away,"]
    expected = [tokenizer(p).input_ids for p in prompts]
    extra = {"return_token_ids": True}
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, n=2, extra_body=extra)
    assert len(whole.choices) == 4
    for choice in whole.choices:
        assert choice.model_extra["prompt_token_ids"] == expected[choice.index // 2]
    seen: dict[int, list] = {}
    for chunk in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=3, n=2, stream=True, extra_body=extra
    ):
        for choice in chunk.choices:
            seen.setdefault(choice.index, []).append(choice.model_extra.get("prompt_token_ids"))
    assert sorted(seen) == [0, 1, 2, 3]
    for index, ids in seen.items():
        assert ids[0] == expected[index // 2] and all(i is None for i in ids[1:])
    plain = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=2)
    assert "prompt_token_ids" not in (plain.choices[0].model_extra or {})

    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat_ids = list(getattr(chat_ids, "input_ids", chat_ids))
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, extra_body=extra)
    assert out.model_extra["prompt_token_ids"] == chat_ids
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True, extra_body=extra)
    )
    firsts = [c.model_extra.get("prompt_token_ids") for c in chunks]
    assert firsts[0] == chat_ids and all(f is None for f in firsts[1:])


def check_continuous_usage(client: openai.OpenAI) -> None:
    """Every chunk carries the usage so far: the prompt's size, completion tokens that never
    fall and cover what was shown, and the final usage chunk's count at the end."""
    prompt = [5, 17, 400, 9000, 33]
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    shown, counts, final = 0, [], None
    for chunk in stream:
        if not chunk.choices:
            final = chunk.usage
            continue
        shown += len(chunk.choices[0].model_extra["token_ids"])
        assert chunk.usage.prompt_tokens == len(prompt)
        assert chunk.usage.completion_tokens >= shown
        counts.append(chunk.usage.completion_tokens)
    assert counts == sorted(counts) and counts[-1] == final.completion_tokens == 8
    without = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(without)
    assert chunks[-1].usage.completion_tokens == 2 and not chunks[-1].choices  # the usage chunk
    assert all(c.usage is None for c in chunks[:-1])  # and only it


def check_min_tokens(client: openai.OpenAI) -> None:
    """EOS waits until ``min_tokens`` tokens are out: the answer equals the same request with
    EOS biased away (``logit_bias``, itself checked against LLM); stop strings wait too."""
    messages = [{"role": "user", "content": "Is 2+2=4? Answer only yes or no."}]
    extra = {"return_token_ids": True}
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, extra_body=extra
    )
    ids = plain.choices[0].model_extra["token_ids"]
    assert plain.choices[0].finish_reason == "stop" and len(ids) < 10, ids  # it ends early by itself
    held = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={**extra, "min_tokens": 10}
    )
    biased = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, logit_bias={str(ids[-1]): -100}, extra_body=extra
    )
    assert held.usage.completion_tokens == 10
    assert held.choices[0].model_extra["token_ids"] == biased.choices[0].model_extra["token_ids"]
    assert held.choices[0].message.content == biased.choices[0].message.content
    first = plain.choices[0].message.content[:2]  # a stop string the answer begins with
    cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stop=[first])
    assert cut.choices[0].message.content == ""
    late = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stop=[first], extra_body={"min_tokens": 3}
    )
    assert late.choices[0].message.content.startswith(first) and late.usage.completion_tokens >= 3


def check_guided_names(client: openai.OpenAI) -> None:
    """vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``
    constrain the answer as ``structured_outputs`` does: the same greedy text, which matches."""
    messages = [{"role": "user", "content": "Is the sky blue? Give an answer."}]
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}
    cases = [
        ("choice", ["yes", "no"], lambda text: text in ("yes", "no")),
        ("regex", "[0-9]{3}", lambda text: re.fullmatch("[0-9]{3}", text) is not None),
        ("json", schema, lambda text: isinstance(json.loads(text)["answer"], bool)),
        ("grammar", 'root ::= "sure" | "never"', lambda text: text in ("sure", "never")),
    ]
    for kind, value, matches in cases:
        texts = [
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=40, temperature=0, extra_body=body
            )
            .choices[0]
            .message.content
            for body in ({f"guided_{kind}": value}, {"structured_outputs": {kind: value}})
        ]
        assert texts[0] == texts[1] and matches(texts[0]), (kind, texts)


def check_partial_character_logprobs(client: openai.OpenAI) -> None:
    """Tokens that hold part of a character (an emoji is several byte tokens): chat log-probs
    give each token's own bytes, which join into the answer's UTF-8; completion offsets never
    go back and point into the text at the character each token begins or continues."""
    messages = [{"role": "user", "content": "Reply with only the emoji 👍"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert any(not c.token or c.token.startswith("bytes:") for c in content)  # the case under test
    joined = b"".join(bytes(c.bytes) for c in content)
    assert joined.decode("utf-8") == out.choices[0].message.content
    for c in content:
        assert c.token.startswith("bytes:") or bytes(c.bytes) == c.token.encode()
    prompt = "Emojis: 💎💉👍 and 中文"
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=0, echo=True)
    text, lp = done.choices[0].text, done.choices[0].logprobs
    assert text.startswith(prompt) and len(lp.text_offset) == len(lp.tokens)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    for token, offset in zip(lp.tokens, lp.text_offset):
        if not token.startswith("bytes:"):
            assert text[offset:].startswith(token), (token, offset, text)


def check_one_finish_per_choice(client: openai.OpenAI) -> None:
    """n = 2 sampled choices that end at different steps: a stream sends each choice's finish
    once (it repeated the first one's at every later chunk) and joins to the same texts as the
    same seeded request without streaming."""
    ask = {"model": MODEL, "max_tokens": 24, "n": 2, "temperature": 1.0, "seed": 5, "stop": [" "]}
    completions = (client.completions.create, {"prompt": "Name some colors:"}, lambda c: c.text, lambda c: c.text)
    chat = (client.chat.completions.create, {"messages": CHAT}, lambda c: c.message.content, lambda c: c.delta.content)
    for create, extra, whole_text, chunk_text in (completions, chat):
        expected = {c.index: whole_text(c) for c in create(**ask, **extra).choices}
        texts: dict[int, str] = {0: "", 1: ""}
        finishes: dict[int, int] = {0: 0, 1: 0}
        for chunk in create(**ask, **extra, stream=True):
            for c in chunk.choices:
                texts[c.index] += chunk_text(c) or ""
                finishes[c.index] += c.finish_reason is not None
        assert finishes == {0: 1, 1: 1}, finishes
        assert texts == expected
        assert len(expected[0]) != len(expected[1])  # the seed makes them end apart

"""OpenAI-surface checks run the same against `serve` (test_api_server.py) and through the P/D
router (test_router.py): vLLM's ``return_token_ids`` with the prompt's ids, and
``stream_options.continuous_usage_stats``. The reference for prompt ids is the tokenizer in this
process (and the chat template, for chat)."""

from __future__ import annotations

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

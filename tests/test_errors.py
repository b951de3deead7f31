"""Bad input gets a clear error, and the engine keeps serving afterwards."""

from __future__ import annotations

import pytest
from conftest import assert_blocks_back, make_llm

from pdinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return make_llm(max_model_len=256)


def _still_serves(llm):
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4
    assert_blocks_back(llm.engine)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, -5]}, "token ids"),
        ({"prompt_token_ids": [10**9]}, "token ids"),
        ({"text": "no ids"}, "prompt_token_ids"),
        (42, "a prompt is text"),
    ],
)
def test_bad_prompts_raise_before_anything_runs(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine", prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.requests  # the good prompt of the batch was not added either
    _still_serves(llm)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n must be"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_over_the_context_ends_with_an_error_not_a_truncation(llm, tokenizer):
    long_ids = tokenizer("word " * 400).input_ids
    assert len(long_ids) > 256
    outs = llm.generate([{"prompt_token_ids": long_ids}, "Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "error"
    assert "exceeds the limit of 256 tokens" in outs[0].error
    assert outs[0].outputs[0].token_ids == []
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 3
    _still_serves(llm)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM(model=str(tmp_path / "weights.bin"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(model=str(tmp_path))


def test_duplicate_request_id_is_refused(llm):
    llm.engine.add_request("dup", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("dup", "Hello", SamplingParams(max_tokens=2))
    llm.engine.abort_request("dup")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    _still_serves(llm)

"""Bad input gets a clear error, and the engine keeps serving afterwards."""

from __future__ import annotations

import logging

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
        ({"prompt_token_ids": [5, 2**70]}, "token ids"),
        ({"prompt_token_ids": [5, 1.0]}, "token ids"),
        ({"prompt_token_ids": [5, "7"]}, "token ids"),
        ({"prompt_token_ids": [5, None]}, "token ids"),
        ({"prompt_token_ids": "57"}, "token ids"),
        ({"prompt_token_ids": [[5, 7]]}, "token ids"),
        ({"prompt_token_ids": [True, 2]}, "token ids"),  # array("q") took it as [1, 2]
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
        # What a stranger may send to an engine entry point (/pd/decode, /pd/prefill take any
        # SamplingParams field): each would have killed the engine loop or hung a request.
        ({"logprobs": 100_000}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"n": 10**6}, "n must be"),
        ({"n": True}, "n must be"),
        ({"top_k": 2**63}, "top_k"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"stop": ["x"] * 1000}, "stop"),
        ({"stop": ["x" * 100_000]}, "stop"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(100_000))}, "stop_token_ids"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"temperature": "hot"}, "temperature"),
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


@pytest.mark.parametrize("params", [{"max_tokens": 2}, 5, [SamplingParams(), {"max_tokens": 2}]])
def test_sampling_params_of_another_type_raise_value_error(llm, params):
    prompts = ["Hi"] * (len(params) if isinstance(params, list) else 1)
    with pytest.raises(ValueError, match="must be SamplingParams"):  # an AttributeError before
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.requests
    _still_serves(llm)


@pytest.mark.parametrize(
    "messages", ["hello", [], [{"role": "wizard", "content": "hi"}], [["not a message"]], [{"content": "no role"}]]
)
def test_chat_checks_its_messages(llm, messages):
    with pytest.raises(ValueError, match="messages"):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.requests


def test_chat_gives_a_developer_message_to_the_template_as_system(llm):
    params = SamplingParams(temperature=0, max_tokens=6)
    turns = [{"role": "user", "content": "Name a colour."}]
    as_system = llm.chat([{"role": "system", "content": "Answer in French."}, *turns], params, use_tqdm=False)
    as_developer = llm.chat([{"role": "developer", "content": "Answer in French."}, *turns], params, use_tqdm=False)
    assert as_developer[0].prompt_token_ids == as_system[0].prompt_token_ids
    assert as_developer[0].outputs[0].text == as_system[0].outputs[0].text


def test_sampling_params_changed_after_construction_are_checked_again(llm):
    params = SamplingParams(max_tokens=2, logprobs=2)
    params.logprobs = 100_000  # the engine verifies what it receives, not what was once valid
    with pytest.raises(ValueError, match="logprobs"):
        llm.engine.add_request("late", "Hello", params)
    assert "late" not in llm.engine.requests
    _still_serves(llm)


# --- requests the KV cache can never hold ---------------------------------------------------------
@pytest.fixture(scope="module")
def small_cache_llm():
    return make_llm(num_kv_blocks=8, max_model_len=256)  # 8 blocks of 16: 128 tokens of K/V


def _run_bounded(engine, max_steps: int = 400) -> dict:
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        for out in engine.step():
            outs[out.request_id] = out
    raise AssertionError(f"still unfinished after {max_steps} steps: {sorted(engine.requests)}")


@pytest.mark.parametrize(
    "num_prompt_tokens, max_tokens, message",
    [(200, 4, "prompt of 200 tokens"), (48, 100, "max_tokens 100")],  # 200 > 128; 48 + 99 > 128
)
def test_a_request_the_kv_cache_can_never_hold_is_refused_at_admission(
    small_cache_llm, num_prompt_tokens, max_tokens, message
):
    engine = small_cache_llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with pytest.raises(ValueError, match=message):
        engine.add_request("too-big", {"prompt_token_ids": [100] * num_prompt_tokens}, params)
    assert "too-big" not in engine.requests
    # Nothing was left behind to block the queue: a request that fits runs at once.
    engine.add_request("fits", {"prompt_token_ids": [100] * 48}, params.clone(max_tokens=4))
    assert _run_bounded(engine)["fits"].outputs[0].token_ids.__len__() == 4
    assert_blocks_back(engine)


def test_an_open_ended_request_ends_with_length_when_the_cache_is_full(small_cache_llm):
    engine = small_cache_llm.engine
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    engine.add_request("open", {"prompt_token_ids": [100] * 48}, params)
    out = _run_bounded(engine)["open"]
    assert out.error is None and out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 128 - 48 + 1  # every K/V slot used
    assert_blocks_back(engine)


def test_a_cache_smaller_than_the_context_is_a_warning_at_start_up(caplog):
    logger = logging.getLogger("pdinfer")  # it does not propagate to the root logger
    logger.addHandler(caplog.handler)
    try:
        make_llm(num_kv_blocks=8, max_model_len=256)
    finally:
        logger.removeHandler(caplog.handler)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("128 tokens" in w and "max_model_len" in w for w in warnings), warnings

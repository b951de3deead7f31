"""Greedy output equals transformers' greedy output, token for token (float32, same GGUF)."""

from __future__ import annotations

import pytest
from conftest import assert_blocks_back, make_llm

from pdinfer import SamplingParams

NEW_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _check(llm, prompt_ids, reference):
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY, use_tqdm=False)
    for ids, out in zip(prompt_ids, outputs):
        assert out.outputs[0].token_ids == reference(ids, NEW_TOKENS), f"prompt of {len(ids)} tokens"
        assert out.outputs[0].finish_reason == "length"
    assert_blocks_back(llm.engine)
    return outputs


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def test_batch_of_mixed_lengths_matches_transformers(llm, prompt_ids, reference):
    assert len({len(ids) for ids in prompt_ids}) >= 8
    _check(llm, prompt_ids, reference)


def test_small_decode_steps_read_the_gguf_blocks_and_match_transformers(llm, prompt_ids, reference):
    from pdinfer.layers.cpu_linear import PackedLinear

    layers = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, PackedLinear)]
    spec = llm.engine.spec
    assert len(layers) == 4 * spec.num_layers + 1  # qkv, o, gate_up, down per layer; the tied head
    assert all(layer.quant is not None for layer in layers)
    # Alone (batch-1 decode steps) and three at a time: the quantized path, against the floats.
    for group in ([prompt_ids[0]], prompt_ids[1:4]):
        _check(llm, group, reference)


def test_native_decode_stack_equals_the_torch_modules(llm, prompt_ids, reference):
    """CPU decode steps run the decoder layers as one native call (``cpu_decode_stack``); the
    torch modules are its reference: the same tokens and bit-identical log-probabilities, with
    1 and 4 sequences (row-streaming GEMMs), 6 (the tiled GEMM) and 33 (with AMX, the AMX GEMM)."""
    model = llm.engine.model_runner.model
    stack = model.decode_stack
    assert stack is not None and stack.max_rows >= 6
    rows_seen = []

    def counting_run(x, *args):
        rows_seen.append(x.shape[0])
        return type(stack).run(stack, x, *args)

    stack.run = counting_run
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    try:
        many = (prompt_ids * 33)[:33]
        for group in ([prompt_ids[0]], prompt_ids[:4], prompt_ids[:6], many):
            requests = [{"prompt_token_ids": ids} for ids in group]
            native = llm.generate(requests, params, use_tqdm=False)
            model.decode_stack = None
            modules = llm.generate(requests, params, use_tqdm=False)
            model.decode_stack = stack
            for a, b in zip(native, modules):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
                assert a.outputs[0].logprobs == b.outputs[0].logprobs
    finally:
        model.decode_stack = stack
        del stack.run
    assert {1, 4, 6, 33} <= set(rows_seen)
    _check(llm, prompt_ids[:6], reference)


def test_text_prompts_tokenize_like_transformers(llm, tokenizer):
    text = "The capital of France is"
    by_text = llm.generate([text], GREEDY, use_tqdm=False)[0]
    assert by_text.prompt_token_ids == tokenizer(text).input_ids
    assert by_text.outputs[0].text == tokenizer.decode(by_text.outputs[0].token_ids, skip_special_tokens=True)


def test_chunked_prefill_matches_transformers(prompt_ids, reference):
    longest = max(len(ids) for ids in prompt_ids)
    llm = make_llm(chunked_prefill=True, max_num_batched_tokens=32)
    assert longest > 32
    _check(llm, prompt_ids, reference)


def test_prefix_cache_hits_match_transformers(llm, tokenizer, reference):
    prefix = tokenizer("You are a careful assistant. Answer in one short sentence. " * 6).input_ids
    questions = ["What is the tallest mountain?", "Why is the sky blue?", "Name a prime number."]
    prompts = [prefix + tokenizer(" " + q).input_ids for q in questions]
    first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)[0]
    assert first.metrics.num_cached_tokens == 0
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False)
    block = llm.engine.cache_config.block_size
    for ids, out in zip(prompts[1:], rest):
        assert out.metrics.num_cached_tokens >= (len(prefix) // block - 1) * block
        assert out.outputs[0].token_ids == reference(ids, NEW_TOKENS)
    assert first.outputs[0].token_ids == reference(prompts[0], NEW_TOKENS)
    assert_blocks_back(llm.engine)


@pytest.mark.parametrize("zos", ["0", "1"])
def test_preemption_and_recompute_matches_transformers(prompt_ids, reference, monkeypatch, zos):
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", zos)
    # 30 blocks of 16 tokens cannot hold 10 sequences of 40-130 tokens at once.
    llm = make_llm(num_kv_blocks=30, enable_prefix_caching=False, max_num_batched_tokens=8192)
    _check(llm, prompt_ids, reference)
    assert llm.engine.scheduler.num_preemptions > 0


def test_zero_overhead_scheduling_on_and_off_identical(prompt_ids, monkeypatch):
    params = [
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            seed=i,
            max_tokens=24,
            ignore_eos=True,
            presence_penalty=0.5 * (i % 2),
            repetition_penalty=1.0 + 0.1 * (i % 3),
        )
        for i in range(len(prompt_ids))
    ]
    runs = []
    for zos in ("0", "1"):
        monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", zos)
        llm = make_llm()
        assert llm.engine.zero_overhead is (zos == "1")
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        assert_blocks_back(llm.engine)
    assert runs[0] == runs[1]

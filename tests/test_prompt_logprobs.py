"""``SamplingParams.prompt_logprobs`` through the LLM API, against transformers' log-softmax over
the whole prompt (float32, same GGUF): chunked prefill split small, a prefix-cache hit, a batch
mixing requests with and without them (the others' rows are never scored), n > 1, a one-token
prompt, and the validation."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import PROMPTS, assert_blocks_back, make_llm

from pdinfer import SamplingParams

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def reference_logprobs(hf_model):
    """``reference(ids)``: [len(ids) - 1, vocab] log-probs of token i + 1 after tokens 0..i."""

    @functools.cache
    def run(ids: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1)

    return lambda ids: run(tuple(ids))


def check_prompt_logprobs(out, k: int, reference) -> None:
    """``out.prompt_logprobs`` against the reference: each prompt token's log-prob first, then
    the top k (the prompt token counts once when it is among them); a top id may differ from the
    reference's only where the two tie."""
    ids = out.prompt_token_ids
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    ref = reference(ids)
    for pos in range(1, len(ids)):
        entry, row, token = got[pos], ref[pos - 1], ids[pos]
        keys = list(entry)
        assert keys[0] == token, (pos, entry)  # the prompt token first, as vLLM lists it
        assert len(entry) in (k, k + 1), (pos, entry)
        tops = keys[1:] if len(entry) == k + 1 else keys
        for tid in keys:
            assert entry[tid] == pytest.approx(row[tid].item(), abs=TOLERANCE), (pos, tid)
        if k:
            kth = row.topk(k).values[-1].item()
            assert all(row[tid].item() >= kth - TOLERANCE for tid in tops), f"not the top {k} at {pos}"


@pytest.fixture(scope="module")
def chunked_llm():
    return make_llm(chunked_prefill=True, max_num_batched_tokens=16)


def test_chunked_prefill_mixed_batch_matches_transformers(chunked_llm, prompt_ids, reference_logprobs):
    """Prompts of 5-55 tokens in chunks of 16 tokens: each request asking scores every prompt
    token; its neighbours (no prompt_logprobs) get none, and no output changes."""
    llm = chunked_llm
    ks = [0, None, 5, None, 2, None, 20, None, 1, None]
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=k) for k in ks]
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    scored_rows: list[int] = []
    execute = llm.engine.model_runner.execute

    def recording(inp):
        scored_rows.append(len(inp.prompt_rows))
        return execute(inp)

    llm.engine.model_runner.execute = recording
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        scored = sum(scored_rows)
        scored_rows.clear()
        plain = llm.generate(prompts, params[1], use_tqdm=False)  # nobody asks
    finally:
        del llm.engine.model_runner.execute
    assert max(len(ids) for ids in prompt_ids) > 3 * 16  # several chunks
    for out, k, alone in zip(outs, ks, plain):
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert alone.prompt_logprobs is None
        if k is None:
            assert out.prompt_logprobs is None
        else:
            check_prompt_logprobs(out, k, reference_logprobs)
    # exactly the asking requests' rows were scored (prompt tokens after the first); then none
    assert scored == sum(len(ids) - 1 for ids, k in zip(prompt_ids, ks) if k is not None)
    assert scored_rows and not any(scored_rows)
    assert_blocks_back(llm.engine)


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(chunked_llm, tokenizer, reference_logprobs):
    """The prefix is cached by a first request; a second one asking for prompt log-probs takes
    no cached block (their logits are not kept) and scores every token; one beside it that does
    not ask takes the cache."""
    llm = chunked_llm
    prefix = tokenizer("You are a careful assistant. Answer in one short sentence. " * 4).input_ids
    first, second, third = (prefix + tokenizer(" " + q).input_ids for q in ("Why?", "How so?", "When?"))
    llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=1), use_tqdm=False)
    scored, plain = llm.generate(
        [{"prompt_token_ids": second}, {"prompt_token_ids": third}],
        [SamplingParams(max_tokens=2, prompt_logprobs=3), SamplingParams(max_tokens=2)],
        use_tqdm=False,
    )
    block = llm.engine.cache_config.block_size
    assert plain.metrics.num_cached_tokens >= (len(prefix) // block - 1) * block > 0
    assert scored.metrics.num_cached_tokens == 0
    check_prompt_logprobs(scored, 3, reference_logprobs)
    assert_blocks_back(llm.engine)


def test_n_outputs_share_one_prompt_logprobs_and_short_prompts(chunked_llm, prompt_ids, reference_logprobs):
    llm = chunked_llm
    out = llm.generate(
        [{"prompt_token_ids": prompt_ids[3]}],
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    assert len(out.outputs) == 3
    check_prompt_logprobs(out, 2, reference_logprobs)
    one = llm.generate([{"prompt_token_ids": [42]}], SamplingParams(max_tokens=2, prompt_logprobs=4), use_tqdm=False)
    assert one[0].prompt_logprobs == [None]  # no token before the first: nothing to score
    assert_blocks_back(llm.engine)


def test_steps_run_as_sub_batches_give_the_same_values(chunked_llm, prompt_ids, reference_logprobs, monkeypatch):
    """A CPU prefill step over several sequences runs as sub-batches (``_prefill_subbatches``):
    the scored rows are picked out of each."""
    from pdinfer.worker import cpu_runner

    monkeypatch.setattr(cpu_runner, "PREFILL_SUBBATCH_TOKENS", 6)
    outs = chunked_llm.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids],
        SamplingParams(max_tokens=1, prompt_logprobs=2),
        use_tqdm=False,
    )
    for out in outs:
        check_prompt_logprobs(out, 2, reference_logprobs)
    assert_blocks_back(chunked_llm.engine)


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_prompt_logprobs_is_checked_like_logprobs(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20


def test_text_prompts_keep_their_tokens(chunked_llm, tokenizer):
    out = chunked_llm.generate(PROMPTS[1], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = tokenizer(PROMPTS[1]).input_ids
    assert [next(iter(e)) for e in out.prompt_logprobs[1:]] == ids[1:]
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # k = 0: the prompt token alone

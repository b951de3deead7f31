"""The sampler against hand-computed distributions, then its draws statistically, then
seeded determinism at the engine level.

Expectations are written out by hand (``math.exp`` of the logits that survive each filter);
the code under test is never used to build them.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import make_llm
from scipy.stats import chisquare

from pdinfer import SamplingParams
from pdinfer.worker.input_builder import build_sampling_tensors
from pdinfer.worker.sampler import Sampler, apply_penalties, filtered_probs, uniform_noise
from pdinfer.worker.step_input import SampleSpec

E = math.exp
# log of [0.5, 0.25, 0.15, 0.1] in a shuffled order: token 2 is 0.5, 0 is 0.25, 3 is 0.15, 1 is 0.1
QUARTERS = [math.log(0.25), math.log(0.1), math.log(0.5), math.log(0.15)]
# Composition case: vocab 6, temperature 2 halves the logits to [1, .5, 0, -.5, 1.5, .25].
COMPOSED_LOGITS = [2.0, 1.0, 0.0, -1.0, 3.0, 0.5]
COMPOSED_PARAMS = dict(temperature=2.0, top_k=4, top_p=0.8, min_p=0.4)
# top_k=4 keeps tokens 4, 0, 1, 5 (scaled 1.5, 1, .5, .25), renormalized .4423 .2683 .1627 .1267;
# top_p=0.8 on that: mass before token 5 is .8733 >= .8, so it goes; {4, 0, 1} -> .5065 .3072
# .1863 (top-p on the full distribution would keep token 5: mass before it .7538 < .8);
# min_p=0.4: threshold .4 * .5065 = .2026 drops token 1; left {4, 0} in ratio e^1.5 : e^1.
COMPOSED_EXPECTED = [E(1) / (E(1.5) + E(1)), 0, 0, 0, E(1.5) / (E(1.5) + E(1)), 0]


def spec(
    temperature=1.0,
    top_k=-1,
    top_p=1.0,
    min_p=0.0,
    seed=0,
    position=0,
    presence=0.0,
    frequency=0.0,
    repetition=1.0,
    prompt=None,
    output=None,
) -> SampleSpec:
    penalized = presence != 0 or frequency != 0 or repetition != 1
    return SampleSpec(
        row=0,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        position=position,
        presence=presence,
        frequency=frequency,
        repetition=repetition,
        output_tokens=output if penalized else None,
        prompt_tokens=prompt if penalized else None,
    )


def tensors(specs: list[SampleSpec], vocab: int):
    return build_sampling_tensors(specs, vocab, torch.device("cpu"))


def probs_of(logits: list[list[float]], specs: list[SampleSpec]) -> torch.Tensor:
    return filtered_probs(torch.tensor(logits), tensors(specs, len(logits[0])))


def close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-6, rtol=1e-5)


# --- filtered_probs: one filter at a time -----------------------------------------------------
def test_temperature_scales_logits():
    total = E(2) + E(4) + E(6) + E(0)  # logits [1, 2, 3, 0] / 0.5
    close(
        probs_of([[1.0, 2.0, 3.0, 0.0]], [spec(temperature=0.5)])[0],
        [E(2) / total, E(4) / total, E(6) / total, E(0) / total],
    )


def test_greedy_row_next_to_sampled_rows_is_untouched_by_temperature():
    total = E(1) + E(2)
    probs = probs_of([[1.0, 2.0], [1.0, 2.0]], [spec(temperature=0.0), spec(temperature=0.5)])
    close(probs[0], [E(1) / total, E(2) / total])  # temperature 0 divides by 1 here; argmax later
    close(probs[1], [E(2) / (E(2) + E(4)), E(4) / (E(2) + E(4))])


def test_top_k_keeps_the_k_best():
    total = E(3.0) + E(2.5)
    close(probs_of([[1.0, 3.0, 2.0, 0.5, 2.5]], [spec(top_k=2)])[0], [0, E(3.0) / total, 0, 0, E(2.5) / total])


def test_top_k_keeps_every_tie_at_the_kth_value():
    close(probs_of([[2.0, 1.0, 2.0, 2.0, 0.0]], [spec(top_k=2)])[0], [1 / 3, 0, 1 / 3, 1 / 3, 0])
    close(probs_of([[1.0, 1.0, 0.0, -1.0]], [spec(top_k=1)])[0], [0.5, 0.5, 0, 0])


def test_top_k_off_rows_keep_everything():
    probs = probs_of([[1.0, 0.0, -1.0], [1.0, 0.0, -1.0]], [spec(top_k=1), spec(top_k=-1)])
    total = E(1) + E(0) + E(-1)
    close(probs[0], [1, 0, 0])
    close(probs[1], [E(1) / total, E(0) / total, E(-1) / total])


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.7, [0.25 / 0.75, 0, 0.5 / 0.75, 0]),  # 0.5 < 0.7 <= 0.5 + 0.25
        (0.8, [0.25 / 0.9, 0, 0.5 / 0.9, 0.15 / 0.9]),  # 0.75 < 0.8 <= 0.9
        (0.3, [0, 0, 1, 0]),  # the best token alone reaches it
        (0.01, [0, 0, 1, 0]),  # at least one token is kept
        (0.95, [0.25, 0.1, 0.5, 0.15]),  # 0.9 < 0.95: every token is needed
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, expected):
    close(probs_of([QUARTERS], [spec(top_p=top_p)])[0], expected)


def test_top_p_one_is_off_even_for_tiny_probabilities():
    # Token 1 has probability ~2e-9: the float32 mass of the better tokens rounds to 1.0.
    # (The second row only switches the top-p path on for the batch.)
    probs = probs_of([[0.0, -20.0, 0.0], [2.0, 0.0, 0.0]], [spec(top_p=1.0), spec(top_p=0.5)])
    total = 2 * E(0) + E(-20)
    close(probs[0], [E(0) / total, E(-20) / total, E(0) / total])
    assert probs[0, 1] > 0
    close(probs[1], [1, 0, 0])


@pytest.mark.parametrize(
    "min_p, expected",
    [
        (0.25, [0.25 / 0.9, 0, 0.5 / 0.9, 0.15 / 0.9]),  # threshold 0.125 drops 0.1
        (0.4, [0.25 / 0.75, 0, 0.5 / 0.75, 0]),  # threshold 0.2 drops 0.15 and 0.1
        (1.0, [0, 0, 1, 0]),  # only the best survives
    ],
)
def test_min_p_is_relative_to_the_max_probability(min_p, expected):
    close(probs_of([QUARTERS], [spec(min_p=min_p)])[0], expected)


def test_filters_compose_in_the_documented_order():
    close(probs_of([COMPOSED_LOGITS], [spec(**COMPOSED_PARAMS)])[0], COMPOSED_EXPECTED)


# --- apply_penalties ---------------------------------------------------------------------------
PENALTY_LOGITS = [2.0, -1.0, 0.5, 3.0, -0.5, 0.0]


def test_repetition_penalty_over_prompt_and_output():
    t = tensors([spec(repetition=2.0, prompt=[0, 1], output=[4, 4, 5]), spec(prompt=[3, 2, 2], output=[1])], 6)
    out = apply_penalties(torch.tensor([PENALTY_LOGITS] * 2), t)
    # seen {0, 1, 4, 5}: 2 / 2 = 1; -1 * 2 = -2; -0.5 * 2 = -1; 0 stays 0. Row 2: no penalty.
    close(out[0], [1.0, -2.0, 0.5, 3.0, -1.0, 0.0])
    close(out[1], PENALTY_LOGITS)


def test_frequency_and_presence_penalties_over_output_only():
    t = tensors([spec(frequency=0.5, presence=0.25, prompt=[0, 1], output=[4, 4, 5, 2])], 6)
    out = apply_penalties(torch.tensor([PENALTY_LOGITS]), t)
    # prompt-only tokens 0, 1 untouched; token 4 twice: -0.5 - 2 * 0.5 - 0.25 = -1.75;
    # token 5 once: 0 - 0.5 - 0.25 = -0.75; token 2 once: 0.5 - 0.75 = -0.25.
    close(out[0], [2.0, -1.0, -0.25, 3.0, -1.75, -0.75])


def test_repetition_then_frequency_and_presence():
    t = tensors([spec(repetition=2.0, frequency=0.5, presence=0.25, prompt=[0, 1], output=[4, 4, 3])], 6)
    out = apply_penalties(torch.tensor([PENALTY_LOGITS]), t)
    # token 0: 2 / 2 = 1; token 1: -1 * 2 = -2; token 4: -0.5 * 2 - 2 * 0.5 - 0.25 = -2.25;
    # token 3: 3 / 2 - 0.5 - 0.25 = 0.75.
    close(out[0], [1.0, -2.0, 0.5, 0.75, -2.25, 0.0])


# --- drawing tokens ----------------------------------------------------------------------------
def draw(logits: list[float], count: int, seed: int = 7, **params) -> torch.Tensor:
    """``count`` draws of one row, one per position (the stream is keyed by seed and position)."""
    specs = [spec(seed=seed, position=p, **params) for p in range(count)]
    return Sampler()(torch.tensor([logits] * count), tensors(specs, len(logits))).token_ids


@pytest.mark.parametrize(
    "logits, params, expected",
    [
        ([1.0, 2.0, 3.0, 0.0], dict(temperature=0.5), [E(x) / (E(2) + E(4) + E(6) + E(0)) for x in (2, 4, 6, 0)]),
        (QUARTERS, dict(top_p=0.8), [0.25 / 0.9, 0, 0.5 / 0.9, 0.15 / 0.9]),
        (COMPOSED_LOGITS, COMPOSED_PARAMS, COMPOSED_EXPECTED),
        ([1.0, 0.0, 1.0, 0.5, 1.0, 0.0], dict(top_k=2, temperature=1.3), [1 / 3, 0, 1 / 3, 0, 1 / 3, 0]),
    ],
)
def test_empirical_frequencies_match_the_filtered_distribution(logits, params, expected):
    count = 40000
    tokens = draw(logits, count, **params)
    freq = torch.bincount(tokens, minlength=len(logits)).double() / count
    kept = [i for i, p in enumerate(expected) if p > 0]
    assert all(freq[i] == 0 for i in range(len(logits)) if i not in kept), freq
    assert (freq - torch.tensor(expected, dtype=torch.float64)).abs().max() < 0.01, freq
    observed = [int(freq[i] * count + 0.5) for i in kept]
    assert chisquare(observed, [expected[i] * count for i in kept]).pvalue > 1e-3


def test_filtered_tokens_never_sampled_over_a_large_sweep():
    logits = [0.0] * 256
    logits[3] = 5.0
    tokens = draw(logits, 20000, top_k=1)
    assert (tokens == 3).all(), f"filtered tokens drawn: {tokens[tokens != 3].tolist()}"


def test_noise_is_strictly_inside_the_unit_interval():
    positions = torch.arange(20000)
    u = uniform_noise(torch.full_like(positions, 7), positions, 256)
    assert u.min() > 0 and u.max() < 1
    assert (-torch.log(u)).min() > 0


def test_greedy_rows_return_argmax_of_penalized_logits():
    logits = torch.tensor([[1.0, 5.0, 2.0], [3.0, 2.0, 0.0], [1.0, 5.0, 2.0]])
    specs = [
        spec(temperature=0.0),
        spec(temperature=0.0, repetition=2.0, prompt=[0], output=[]),
        spec(temperature=0.9, seed=3),
    ]
    tokens = Sampler()(logits, tensors(specs, 3)).token_ids
    assert tokens[:2].tolist() == [1, 1]  # row 2: 3 / 2 = 1.5 < 2
    all_greedy = Sampler()(logits[:2], tensors(specs[:2], 3)).token_ids
    assert all_greedy.tolist() == [1, 1]


def test_half_precision_logits_greedy_takes_first_maximum_and_logprobs_run_in_float32():
    # The model's logits arrive in its dtype (final_logits no longer upcasts). bf16 values, chosen
    # exactly representable: row 0 ties at tokens 1 and 3 (the first wins, as torch.argmax on
    # float32 does); row 1's maximum is token 2.
    rows = [[0.5, 2.25, -1.0, 2.25], [1.0, -3.5, 4.0, 0.125]]
    logits = torch.tensor(rows, dtype=torch.bfloat16)
    greedy = [spec(temperature=0.0), spec(temperature=0.0)]
    assert Sampler()(logits, tensors(greedy, 4)).token_ids.tolist() == [1, 2]
    asked = [replace(s, logprobs=2) for s in greedy]
    out = Sampler()(logits, tensors(asked, 4))
    assert out.token_ids.tolist() == [1, 2]
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    expected = [r[t] - math.log(sum(E(x) for x in r)) for r, t in zip(rows, (1, 2))]
    close(out.logprobs, expected)
    # a bias is added in float32: 0.125 + 3.88 = 4.005 beats 4.0 (in bf16 it would round to a tie
    # with token 2, which would win as the first maximum)
    biased = [greedy[0], replace(greedy[1], logit_bias={3: 3.88})]
    assert Sampler()(logits, tensors(biased, 4)).token_ids.tolist() == [1, 3]


def test_same_seed_and_position_give_same_token_in_any_batch():
    logits = [0.3, -0.2, 0.9, 0.1, -1.0, 0.5]
    positions = range(500)
    target = [spec(seed=11, position=p, temperature=0.9, top_p=0.95) for p in positions]
    others = [
        spec(temperature=0.0),
        spec(top_k=2, seed=5, position=9),
        spec(min_p=0.3, seed=1, position=4, repetition=1.3, frequency=0.4, prompt=[1], output=[2, 2]),
    ]
    mixed = [s for pair in zip(target, others * len(target)) for s in pair]
    alone = Sampler()(torch.tensor([logits] * len(target)), tensors(target[::-1], 6)).token_ids.flip(0)
    together = Sampler()(torch.tensor([logits] * len(mixed)), tensors(mixed, 6)).token_ids[::2]
    assert alone.tolist() == together.tolist()
    assert len(set(alone.tolist())) >= 5  # the stream really varies with position
    other_seed = Sampler()(
        torch.tensor([logits] * len(target)),
        tensors([spec(seed=12, position=p, temperature=0.9, top_p=0.95) for p in positions], 6),
    )
    assert other_seed.token_ids.tolist() != alone.tolist()


def test_row_chunks_draw_what_the_whole_batch_draws(monkeypatch):
    """A large batch is sampled in row chunks (bounded memory); every row's token is the one it
    gets when the batch is sampled at once."""
    from pdinfer.worker import sampler

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(29, 40, generator=gen)
    specs = [
        spec(temperature=0.5 + (i % 3) / 2, top_k=(-1, 7)[i % 2], top_p=(1.0, 0.8, 0.6)[i % 3], seed=i, position=i)
        for i in range(29)
    ]
    whole = Sampler()(logits.clone(), tensors(specs, 40)).token_ids
    monkeypatch.setattr(sampler, "SAMPLE_CHUNK_ENTRIES", 3 * 40)  # 3 rows a chunk, 10 chunks
    chunked = Sampler()(logits.clone(), tensors(specs, 40)).token_ids
    assert chunked.tolist() == whole.tolist()
    assert len(set(whole.tolist())) > 5


# --- engine level ------------------------------------------------------------------------------
def test_seeded_request_same_alone_and_in_mixed_batch(prompt_ids):
    llm = make_llm()
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    prompt = {"prompt_token_ids": prompt_ids[3]}
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, seed=1, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.1, max_tokens=16, ignore_eos=True),
        SamplingParams(
            temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, seed=3, max_tokens=28, ignore_eos=True
        ),
        SamplingParams(temperature=1.2, top_p=0.5, frequency_penalty=0.8, max_tokens=20, ignore_eos=True),
        seeded.clone(seed=8),
    ]  # the same prompt with another seed
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids[4:9]] + [prompt]
    outs = llm.generate(prompts[:3] + [prompt] + prompts[3:], others[:3] + [seeded] + others[3:], use_tqdm=False)
    assert len(alone) == 24
    assert outs[3].outputs[0].token_ids == alone
    assert outs[-1].outputs[0].token_ids != alone
    assert llm.engine.get_num_free_blocks() == llm.engine.num_blocks

"""The batch-invariant mode (``EngineArgs(batch_invariant=True)``, ``--batch-invariant``): one
request's logits are bit-identical alone, inside batches of other requests of any size, and with
its prefill cut into chunks of any budget.

The logits are the model runner's own: ``LogitsRecorder`` wraps ``compute_logits`` of the engine's
model and keeps, for one request, the rows that the runner turns into its prompt log-probs
(every prompt position but the last: the request asks for ``prompt_logprobs``, no other does) and
its samples (the last prompt position and every decode step; found by the request's seed, which
no other request shares). Keyed by the position of the input token, they compare run to run with
``torch.equal``; so do the log-probs the engine reports.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdinfer import LLM, SamplingParams

TARGET_SEED = 7_777  # the target request's seed: no other request has it
TARGET_PROMPT_TOKENS = 40
TARGET_NEW_TOKENS = 5


class LogitsRecorder:
    """The logits rows of the request whose seed is ``seed``, by input position, for every step
    the engine runs while recording (``record``)."""

    def __init__(self, llm: LLM, seed: int):
        self.runner = llm.engine.model_runner
        self.seed = seed
        self.rows: dict[int, torch.Tensor] = {}
        self._calls: list[torch.Tensor] = []
        model = self.runner.model
        compute_logits = model.compute_logits
        execute = self.runner._execute

        def recording_logits(hidden):
            logits = compute_logits(hidden)
            self._calls.append(logits.clone())
            return logits

        def recording_execute(inp):
            self._calls.clear()
            result = execute(inp)
            self._collect(inp)
            return result

        model.compute_logits = recording_logits
        self.runner._execute = recording_execute

    def _collect(self, inp) -> None:
        if not self._calls:
            return
        samples, prompt = self._calls[0], self._calls[1:]
        for i, spec in enumerate(inp.samples):
            if spec.seed == self.seed:
                self._keep(inp.positions[spec.row], samples[i])
        if inp.prompt_rows:
            for row, logits in zip(inp.prompt_rows, torch.cat(prompt)):
                self._keep(inp.positions[row], logits)

    def _keep(self, position: int, logits: torch.Tensor) -> None:
        assert position not in self.rows, f"position {position} computed twice"
        self.rows[position] = logits

    def take(self) -> dict[int, torch.Tensor]:
        rows, self.rows = self.rows, {}
        return rows


def random_prompt(rng: random.Random, length: int) -> dict:
    return {"prompt_token_ids": [rng.randrange(100, 40_000) for _ in range(length)]}


def run(llm: LLM, recorder: LogitsRecorder, target: dict, num_others: int, rng: random.Random):
    """The target request among ``num_others`` random short ones (it sits in the middle):
    (its logits by position, its output)."""
    prompts, params = [], []
    for _ in range(num_others):
        prompts.append(random_prompt(rng, rng.randint(1, 24)))
        params.append(
            SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8), ignore_eos=True, seed=rng.randrange(1000))
        )
    middle = num_others // 2
    prompts.insert(middle, target)
    target_params = SamplingParams(
        temperature=0.0,
        max_tokens=TARGET_NEW_TOKENS,
        ignore_eos=True,
        seed=TARGET_SEED,
        logprobs=5,
        prompt_logprobs=5,
    )
    params.insert(middle, target_params)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return recorder.take(), outputs[middle]


def assert_same(reference, other, what: str) -> None:
    ref_rows, ref_out = reference
    rows, out = other
    assert sorted(rows) == sorted(ref_rows) == list(range(TARGET_PROMPT_TOKENS + TARGET_NEW_TOKENS - 1)), what
    differing = [p for p in ref_rows if not torch.equal(ref_rows[p], rows[p])]
    assert not differing, f"{what}: logits differ at positions {differing}"
    assert out.outputs[0].token_ids == ref_out.outputs[0].token_ids, what
    assert out.outputs[0].logprobs == ref_out.outputs[0].logprobs, what
    assert out.prompt_logprobs == ref_out.prompt_logprobs, what


def make(batch_invariant: bool, **kwargs) -> LLM:
    kwargs.setdefault("max_num_seqs", 80)
    return LLM(
        batch_invariant=batch_invariant,
        kv_cache_memory=256 << 20,
        max_model_len=512,
        enable_prefix_caching=False,  # every run computes every prompt position
        **kwargs,
    )


@pytest.fixture(scope="module")
def target():
    return random_prompt(random.Random(1), TARGET_PROMPT_TOKENS)


@pytest.fixture(scope="module")
def invariant_llm():
    llm = make(True)
    return llm, LogitsRecorder(llm, TARGET_SEED)


@pytest.fixture(scope="module")
def alone(invariant_llm, target):
    llm, recorder = invariant_llm
    return run(llm, recorder, target, 0, random.Random(0))


@pytest.mark.parametrize("num_others", [4, 16, 63])
def test_logits_do_not_depend_on_the_batch(invariant_llm, target, alone, num_others):
    llm, recorder = invariant_llm
    batched = run(llm, recorder, target, num_others, random.Random(num_others))
    assert_same(alone, batched, f"alone vs in a batch of {num_others + 1}")


@pytest.mark.parametrize("budget", [16, 7])
def test_logits_do_not_depend_on_prefill_chunks(target, alone, budget):
    llm = make(True, chunked_prefill=True, max_num_batched_tokens=budget)
    chunked = run(llm, LogitsRecorder(llm, TARGET_SEED), target, 3, random.Random(budget))
    assert_same(alone, chunked, f"unchunked vs chunks of {budget} tokens")

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
    kwargs.setdefault("enable_prefix_caching", False)  # every run computes every prompt position
    return LLM(batch_invariant=batch_invariant, kv_cache_memory=256 << 20, max_model_len=1024, **kwargs)


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


def test_long_context_decode_does_not_depend_on_the_batch(invariant_llm):
    """A lone sequence's context of 512 tokens or more is cut into chunks across threads in the
    default mode (and not in a batch); the mode never cuts it."""
    llm, recorder = invariant_llm
    rng = random.Random(5)
    prompt = random_prompt(rng, 600)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, seed=TARGET_SEED)
    llm.generate([prompt], params, use_tqdm=False)
    alone = recorder.take()
    others = [random_prompt(rng, rng.randint(1, 24)) for _ in range(7)]
    other_params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, seed=1)
    llm.generate([*others[:3], prompt, *others[3:]], [other_params] * 3 + [params] + [other_params] * 4, use_tqdm=False)
    batched = recorder.take()
    assert sorted(alone) == sorted(batched) == [599, 600, 601]
    assert all(torch.equal(alone[p], batched[p]) for p in alone)


def test_a_prefix_cache_hit_gives_the_same_logits(target):
    """The second run reads the prompt's full blocks from the prefix cache and computes the rest
    as a chunk: its samples' logits are the first run's."""
    llm = make(True, enable_prefix_caching=True)
    recorder = LogitsRecorder(llm, TARGET_SEED)
    params = SamplingParams(temperature=0.0, max_tokens=TARGET_NEW_TOKENS, ignore_eos=True, seed=TARGET_SEED)
    first = llm.generate([target], params, use_tqdm=False)[0]
    cold = recorder.take()
    second = llm.generate([random_prompt(random.Random(3), 9), target], [params.clone(seed=1), params], use_tqdm=False)
    assert second[1].metrics is not None and second[1].metrics.num_cached_tokens >= 32
    assert first.outputs[0].token_ids == second[1].outputs[0].token_ids
    warm = recorder.take()
    assert (
        sorted(cold)
        == sorted(warm)
        == list(range(TARGET_PROMPT_TOKENS - 1, TARGET_PROMPT_TOKENS + TARGET_NEW_TOKENS - 1))
    )
    assert all(torch.equal(cold[p], warm[p]) for p in cold)


@pytest.mark.parametrize("kind", ["amx", "tiled", "float"])
def test_each_linear_gives_a_row_the_same_result_at_every_row_count(kind):
    """The kernel under each layer of the mode: row i of a call over m rows equals the call over
    row i alone, bit for bit (where the default mode picks a kernel by m)."""
    from pdinfer.layers import cpu_kernels
    from pdinfer.layers.cpu_linear import PackedLinear, QuantWeight

    lib = cpu_kernels.load()
    if lib is None:
        pytest.skip("no native CPU kernels")
    if kind == "amx" and not cpu_kernels.amx_available(lib):
        pytest.skip("no AMX on this CPU")
    gen = torch.Generator().manual_seed(0)
    n, k = 96, 256
    raw = torch.randint(0, 256, (n, k // 32 * 20), dtype=torch.uint8, generator=gen)
    raw.view(n, -1, 20)[..., 0:4] = torch.tensor([0x00, 0x20, 0x00, 0xA0], dtype=torch.uint8)  # d 2^-7, min -2^-5
    quant = QuantWeight.from_gguf("Q4_1", raw) if kind != "float" else None
    weight = quant.dequantize() if quant is not None else torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    layer = PackedLinear(weight, bias, lib, quant, amx=kind == "amx", batch_invariant=True)
    x = torch.randn(70, k, generator=gen)
    alone = [layer(x[i : i + 1]) for i in range(len(x))]
    for m in (1, 3, 4, 5, 9, 31, 32, 33, 70):
        out = layer(x[:m])
        assert all(torch.equal(out[i], alone[i][0]) for i in range(m)), f"{kind}, {m} rows"
    assert torch.allclose(layer(x), torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


def test_the_mode_is_refused_where_it_does_not_exist():
    with pytest.raises(ValueError, match="float32"):
        LLM(batch_invariant=True, dtype="bfloat16", kv_cache_memory=64 << 20)


def test_the_cli_flag_reaches_engine_args():
    from pdinfer.cli import build_parser
    from pdinfer.cli_args import engine_args_from
    from pdinfer.serving.launch import engine_flags

    for command in (["serve"], ["generate", "hi"], ["launch", "--prefill", "1", "--decode", "1"]):
        args = build_parser().parse_args([*command, "--batch-invariant"])
        engine_args = engine_args_from(args)
        assert engine_args.batch_invariant and engine_args.runner_options.batch_invariant, command
        assert not engine_args_from(build_parser().parse_args(command)).batch_invariant, command
    launched = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1", "--batch-invariant"])
    assert "--batch-invariant" in engine_flags(launched)

"""Speculative decoding on the CUDA step path (issue 28, GPU half), run on the CPU: steps go
through ``GpuRunner`` (packed inputs, Triton kernels in Triton's interpreter, asynchronous
results, the worker thread of zero-overhead scheduling) as on a GPU. A CUDA graph cannot be
captured on the CPU: ``_emulate_graphs`` runs each bucket's forward over the graph runner's
static buffers where the replay would.

- which rows the decode CUDA graphs cover: ``decode_graph_rows`` and ``CudaGraphRunner.
  bucket_for`` on verifying steps, against hand-computed buckets;
- one verifying step (1 + 3 rows of a sequence next to another's row): each row's distribution
  is a plain decode step's at its position, eager and from the graphs' buffers (this is what
  checks the attention: the tiny Llama's dummy weights make its tokens depend little on it);
- engines: greedy output with n-gram speculation equals greedy output without it, token for
  token, on that Llama (drafts partly accepted, partly rejected), with zero-overhead scheduling
  on and off, eager and with graphs; the same with the MTP drafter on a tiny DeepSeek-V3
  (``test_mtp.MTPCase``), whose hidden states come from the CUDA step path, and, kept across
  several replays, from the graphs' buffers (its drafts are the reference MTP's).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pdinfer.layers import triton_ops  # noqa: E402

if not triton_ops.HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs Triton's interpreter", allow_module_level=True)

from conftest import assert_blocks_back  # noqa: E402
from test_triton_kernels import TINY_LLAMA as KERNEL_TESTS_LLAMA  # noqa: E402
from test_triton_kernels import _fix_interpreter_scalars  # noqa: E402

from pdinfer import LLM, EngineArgs, SamplingParams, env  # noqa: E402
from pdinfer.engine.speculative import decode_graph_rows  # noqa: E402
from pdinfer.worker.cuda_graph import CudaGraphRunner  # noqa: E402
from pdinfer.worker.gpu_runner import GpuRunner  # noqa: E402
from pdinfer.worker.step_input import SampleSpec, StepInput  # noqa: E402

_fix_interpreter_scalars()

TINY_LLAMA = {**KERNEL_TESTS_LLAMA, "max_position_embeddings": 512}
K = 3


# --- the graphs' buckets ----------------------------------------------------------------------------
def _decode_step(draft_counts: list[int], num_blocks: int = 2) -> StepInput:
    """A decode step as ``StepBuilder`` builds it: a sequence with d drafts is 1 + d rows of one
    query, sharing its block table, each attending up to its own position."""
    inp = StepInput(
        step_id=0, is_prompt=False, input_ids=[], positions=[], query_lens=[], context_lens=[], block_tables=[]
    )
    for s, drafts in enumerate(draft_counts):
        table = list(range(s * num_blocks, (s + 1) * num_blocks))
        for pos in range(10, 11 + drafts):
            inp.input_ids.append(1)
            inp.positions.append(pos)
            inp.query_lens.append(1)
            inp.context_lens.append(pos + 1)
            inp.block_tables.append(table)
    return inp


class _Cache:  # what CudaGraphRunner reads of a cache
    kv = torch.zeros(1)
    block_size = 16


def _graph_runner(max_rows: int) -> CudaGraphRunner:
    return CudaGraphRunner(torch.nn.Identity(), _Cache(), max_rows, max_blocks=8, num_sms=132, decode_programs=2)


@pytest.mark.parametrize(
    ("max_num_seqs", "k", "role", "method", "rows"),
    [
        (8, 3, "normal", "ngram", 32),  # every sequence drafts: 8 x (1 + 3)
        (4, 3, "completion", "mtp", 16),
        (64, 3, "normal", "ngram", 64),  # batches above 16 do not draft: 16 x 4 = 64 = max_num_seqs
        (256, 3, "normal", "ngram", 256),
        (16, 20, "normal", "ngram", 336),  # the graph runner caps it at 256 (below)
        (8, 3, "prompt", "ngram", 8),  # a PE never drafts
        (8, 3, "normal", None, 8),  # num_draft_tokens alone speculates nothing
    ],
)
def test_decode_graph_rows(max_num_seqs, k, role, method, rows):
    args = EngineArgs(max_num_seqs=max_num_seqs, num_draft_tokens=k, engine_type=role, speculative_method=method)
    assert decode_graph_rows(args) == rows


def test_verifying_steps_replay_the_bucket_of_their_rows():
    graphs = _graph_runner(decode_graph_rows(EngineArgs(max_num_seqs=8, speculative_method="ngram")))
    assert graphs.buckets == [1, 2, 4, 8, 16, 24, 32]
    assert graphs.bucket_for(_decode_step([0] * 8)) == 8  # a plain step of 8 sequences
    assert graphs.bucket_for(_decode_step([3, 3, 0, 2, 1])) == 16  # 4 + 4 + 1 + 3 + 2 = 14 rows
    assert graphs.bucket_for(_decode_step([3, 1, 2])) == 16  # 4 + 2 + 3 = 9 rows
    assert graphs.bucket_for(_decode_step([3] * 8)) == 32  # the largest verifying step
    assert graphs.bucket_for(_decode_step([3] * 6)) == 24
    assert graphs.bucket_for(_decode_step([0], num_blocks=9)) is None  # a table wider than max_model_len's
    prefill = StepInput(
        step_id=0,
        is_prompt=True,
        input_ids=[1, 2],
        positions=[0, 1],
        query_lens=[2],
        context_lens=[2],
        block_tables=[[0]],
    )
    assert graphs.bucket_for(prefill) is None
    # without speculation the same engine's graphs stop at max_num_seqs: a verifying step is eager
    plain = _graph_runner(decode_graph_rows(EngineArgs(max_num_seqs=8, num_draft_tokens=3)))
    assert plain.buckets[-1] == 8 and plain.bucket_for(_decode_step([3] * 8)) is None
    capped = _graph_runner(
        decode_graph_rows(EngineArgs(max_num_seqs=16, num_draft_tokens=20, speculative_method="ngram"))
    )
    assert capped.buckets[-1] == 256
    assert capped.bucket_for(_decode_step([20] * 12)) == 256  # 252 rows
    assert capped.bucket_for(_decode_step([20] * 13)) is None  # 273 rows: eager


# --- one verifying step against plain decode steps ---------------------------------------------------
def _sample(row: int, position: int) -> SampleSpec:
    return SampleSpec(row=row, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=position, logprobs=96)


def _distributions(result) -> list[dict[int, float]]:
    """Each sampled row's log-probs over the whole vocabulary, by token."""
    return [dict(zip(ids, lps)) for ids, lps in zip(result.top_ids, result.top_logprobs)]


def _runners(graphs: bool) -> list:
    """Two CUDA step runners on the CPU with the same tiny Llama, caches of 32 blocks of 4."""
    from test_triton_kernels import _tiny_runner

    runners = []
    for _ in range(2):
        runner = _tiny_runner(gpu=True)
        runner.init_cache(num_blocks=32, block_size=4)
        if graphs:
            runner.graphs = _emulate_graphs(runner, 16, 64)
        runners.append(runner)
    return runners


@pytest.mark.parametrize("graphs", [False, True])
def test_a_verifying_step_computes_each_row_as_a_plain_decode_step(graphs):
    """One step of a sequence's 1 + 3 rows (the last known token and three drafts, one block
    boundary among them) next to another sequence's plain row: each row's distribution is the
    one a plain decode step at that position computes (the K/V of the rows before it written
    in the same step and read by it), eager and from the graphs' buffers (12 padding rows)."""
    verifying, plain = _runners(graphs)
    g = torch.Generator().manual_seed(1)
    prompt_a, prompt_b = (torch.randint(0, 96, (n,), generator=g).tolist() for n in (10, 5))
    tail = torch.randint(0, 96, (4,), generator=g).tolist()  # the token at 10, then 3 drafts
    table_a, table_b = [7, 2, 9, 20], [11, 4]
    prefill = StepInput(
        step_id=0,
        is_prompt=True,
        input_ids=prompt_a + prompt_b,
        positions=list(range(10)) + list(range(5)),
        query_lens=[10, 5],
        context_lens=[10, 5],
        block_tables=[table_a, table_b],
        samples=[_sample(9, 10), _sample(14, 5)],
    )
    for runner in (verifying, plain):
        runner.execute(prefill).wait()
    step = StepInput(
        step_id=1,
        is_prompt=False,
        input_ids=tail + [42],
        positions=[10, 11, 12, 13, 5],
        query_lens=[1] * 5,
        context_lens=[11, 12, 13, 14, 6],
        block_tables=[table_a] * 4 + [table_b],
        samples=[_sample(i, p + 1) for i, p in enumerate([10, 11, 12, 13, 5])],
    )
    got = _distributions(verifying.execute(step).wait())
    expected = []
    for i, pos in enumerate([10, 11, 12, 13]):  # sequence A alone, one token a step
        one = StepInput(
            step_id=2 + i,
            is_prompt=False,
            input_ids=[tail[i]],
            positions=[pos],
            query_lens=[1],
            context_lens=[pos + 1],
            block_tables=[table_a],
            samples=[_sample(0, pos + 1)],
        )
        expected += _distributions(plain.execute(one).wait())
    for position, (row, ref) in enumerate(zip(got, expected), start=11):
        assert row.keys() == ref.keys()
        assert [row[t] for t in ref] == pytest.approx(list(ref.values()), rel=2e-6, abs=1e-5), f"position {position}"
    if graphs:
        assert verifying.graphs.num_replays == 1  # the 5 rows replayed the bucket of 8
    torch.testing.assert_close(verifying.cache.kv[table_a], plain.cache.kv[table_a])  # the same K/V written


# --- KV capacity --------------------------------------------------------------------------------------
def test_the_mtp_cache_is_counted_in_the_gpu_kv_budget(monkeypatch):
    """A CUDA engine's profiled budget buys blocks of (layers + 1) / layers the main cache's
    bytes when the MTP layer keeps its latent cache next to it (the device's memory faked)."""
    from test_triton_kernels import _tiny_runner

    from pdinfer.worker.cache_engine import block_bytes

    gib = 2**30
    fake = dict(synchronize=lambda: None, reset_peak_memory_stats=lambda: None, empty_cache=lambda: None)
    fake.update(memory_allocated=lambda: 0, max_memory_allocated=lambda: gib, mem_get_info=lambda: (60 * gib, 80 * gib))
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    runner = _tiny_runner(gpu=True)
    # no memory_bytes on CUDA; block size 4, a decode step of 8 rows, utilization 0.5
    plain, with_mtp = (runner.profile_num_blocks(0, 4, 8, 8, True, 0.5, extra_layers=n) for n in (0, 1))
    budget = (60 - 40 - 1) * gib - runner.kv_profile["reserve"]  # free - (1 - 0.5) x total - peak
    per_block = block_bytes(runner.spec, 4, runner.kv_dtype)  # the tiny Llama's 2 layers
    assert plain == budget // per_block
    assert with_mtp == budget // (per_block * 3 // 2)


# --- engines on the CUDA step path ------------------------------------------------------------------
class _ReplayedForward:
    """A captured graph's stand-in on the CPU: ``replay`` runs the bucket's forward over the
    graph runner's static buffers and writes the outputs where the graph's own are."""

    def __init__(self, graphs: CudaGraphRunner, bucket: int):
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        logits, hidden = self.graphs._forward(self.bucket)
        self.graphs._graphs[self.bucket][1].copy_(logits)
        self.graphs._hidden[self.bucket].copy_(hidden)


def _emulate_graphs(gpu: GpuRunner, max_rows: int, max_model_len: int) -> CudaGraphRunner:
    cache = gpu.require_cache()
    max_blocks = -(-max_model_len // cache.block_size)
    # 4 multiprocessors, not 132: a graph's decode grid is sized for any context (up to 32 splits a
    # row on an H200), which the interpreter runs program by program
    graphs = CudaGraphRunner(gpu.model, cache, max_rows, max_blocks, 4, gpu.decode_programs)
    with torch.inference_mode():
        for b in graphs.buckets:
            logits, hidden = graphs._forward(b)
            graphs._graphs[b] = (_ReplayedForward(graphs, b), logits.clone())
            graphs._hidden[b] = hidden.clone()
    return graphs


def _llm(monkeypatch, zos: bool, graphs: bool = False, **kwargs) -> tuple[LLM, GpuRunner]:
    """An engine on the CUDA step path on CPU tensors: its runner is a ``GpuRunner`` (the
    factory picks by device, so the test picks for it), launched by the engine's own executor
    (worker thread, zero-overhead scheduling as ``zos`` says); ``graphs``: decode steps of up to
    ``decode_graph_rows`` rows go through the graph runner's buffers."""
    from pdinfer.engine import llm_engine

    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "1" if zos else "0")
    monkeypatch.delitem(env._role_defaults, "PDINFER_ZERO_OVERHEAD_SCHEDULING", raising=False)
    monkeypatch.setattr(llm_engine, "make_runner", GpuRunner)
    llm = LLM(**kwargs)
    engine = llm.engine
    assert engine.zero_overhead is zos
    gpu = engine.model_runner
    assert isinstance(gpu, GpuRunner)
    if graphs:
        gpu.graphs = _emulate_graphs(gpu, decode_graph_rows(engine.args), engine.scheduler_config.max_model_len)
    return llm, gpu


def _record_steps(gpu: GpuRunner) -> list[tuple[int, int]]:
    """(sequences, rows) of every decode step the runner ran; a step has more rows than
    sequences where some verify drafts (their rows share a block table)."""
    steps: list[tuple[int, int]] = []
    execute = gpu.execute

    def recording(inp: StepInput):
        tables = inp.block_tables
        if not inp.is_prompt and tables:
            steps.append((1 + sum(tables[i] != tables[i - 1] for i in range(1, len(tables))), len(tables)))
        return execute(inp)

    gpu.execute = recording
    return steps


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama and its prompts: the first repeats the model's own greedy chain
    with one token changed (its n-gram drafts are accepted up to that token, then rejected),
    the second is random (it drafts little); and the greedy tokens without speculation."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    kwargs = dict(model=str(folder), load_format="dummy", num_kv_blocks=64, block_size=4, max_num_seqs=4)
    with pytest.MonkeyPatch.context() as mp:
        base, _ = _llm(mp, zos=True, **kwargs)
    chain = [5] + _generate(base, [[5]], 12)[0]
    copy = list(chain)
    copy[4] = (copy[4] + 1) % TINY_LLAMA["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [copy + chain[:1], torch.randint(0, 96, (11,), generator=g).tolist()]
    expected = _generate(base, prompts, 32)
    base.engine.shutdown()
    return kwargs, prompts, expected


@pytest.mark.parametrize(("zos", "graphs"), [(True, False), (False, False), (True, True)])
def test_ngram_greedy_equals_no_speculation_on_the_cuda_path(llama, monkeypatch, zos, graphs):
    kwargs, prompts, expected = llama
    llm, gpu = _llm(monkeypatch, zos, graphs, speculative_method="ngram", num_draft_tokens=K, **kwargs)
    steps = _record_steps(gpu)
    assert _generate(llm, prompts, 32) == expected
    pool = llm.engine.draft_pool
    assert pool.num_drafted_tokens > pool.num_accepted_tokens > 0, pool.stats()  # accepted and rejected
    assert any(1 < seqs < rows for seqs, rows in steps), steps  # drafting rows among another sequence's
    if graphs:  # every decode step (16 rows at most) ran from the graphs' buffers
        assert gpu.graphs is not None and gpu.graphs.num_replays == len(steps)
    assert_blocks_back(llm.engine)
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    from test_mtp import MTPCase

    return MTPCase(tmp_path_factory.mktemp("mtp-bigram"), bigram=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from test_mtp import MTPCase

    return MTPCase(tmp_path_factory.mktemp("mtp"))


@pytest.mark.parametrize("graphs", [False, True])
def test_mtp_greedy_equals_no_speculation_on_the_cuda_path(bigram, monkeypatch, graphs):
    """The MTP layer reads the hidden states the CUDA step path keeps (eager, or copied out of
    the graphs' buffers): its bigram copy predicts the target's greedy tokens, so (nearly)
    every draft is accepted."""
    from test_mtp import _prompts

    prompts = _prompts((6, 40), seed=3)
    base, _ = _llm(monkeypatch, True, model=bigram.folder, num_kv_blocks=64, max_num_seqs=4)
    expected = _generate(base, prompts, 16)
    base.engine.shutdown()
    llm, gpu = _llm(
        monkeypatch, True, graphs, model=bigram.folder, num_kv_blocks=64, max_num_seqs=4, speculative_method="mtp"
    )
    assert _generate(llm, prompts, 16) == expected
    pool = llm.engine.draft_pool
    assert pool.num_drafted_tokens >= 8 and pool.acceptance_rate > 0.95, pool.stats()
    if graphs:
        assert gpu.graphs is not None and gpu.graphs.num_replays > 0
    assert pool.drafter.num_tracked == 0
    assert_blocks_back(llm.engine)
    llm.engine.shutdown()


def test_mtp_drafts_from_hidden_states_out_of_the_graphs_are_the_reference_drafts(case, monkeypatch):
    """Two sequences in a batch too large to draft (``max_batch`` 1) keep the hidden states of
    several replays waiting; once one finishes, the other drafts over its whole context. Every
    draft and its MTP logits equal the reference MTP's after the same tokens (hidden states
    that a later replay overwrote would not), and output equals output without speculation."""
    from test_mtp import _prompts, _record_drafts, _same_logits

    prompts = _prompts((5, 12), seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 16)]
    kwargs = dict(model=case.folder, num_kv_blocks=64, max_num_seqs=4)
    base, _ = _llm(monkeypatch, True, **kwargs)
    expected = [
        o.outputs[0].token_ids
        for o in base.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    base.engine.shutdown()
    llm, gpu = _llm(monkeypatch, True, True, speculative_method="mtp", **kwargs)
    monkeypatch.setattr(llm.engine.draft_pool, "max_batch", 1)
    logits: list[list[torch.Tensor]] = []
    calls = _record_drafts(llm.engine.draft_pool.drafter, logits)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert calls and all(len(tokens) >= 5 + 16 for tokens, _ in calls)  # only after the other finished
    for (tokens, drafts), got in zip(calls, logits):
        ref_drafts, ref_logits = case.drafts(tokens, len(drafts))
        assert drafts == ref_drafts and _same_logits(got, ref_logits), f"after {len(tokens)} tokens"
    assert gpu.graphs is not None and gpu.graphs.num_replays > 0
    assert_blocks_back(llm.engine)
    llm.engine.shutdown()

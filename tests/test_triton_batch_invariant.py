"""The batch-invariant mode's CUDA kernels (``EngineArgs(batch_invariant=True)`` on a GPU), run
on the CPU by Triton's interpreter at tiny shapes: a row's result is bit-identical whatever else
shares its launch, and close to a float64 reference.

- ``bi_matmul`` (``layers/triton_gemm.py``), the GEMM under every linear: row i of a call over M
  rows equals the call over that row alone, for M in 1, 3, 17, 64;
- decode attention (``triton_paged``, ``batch_invariant=True``): a sequence alone and inside
  batches of longer and shorter contexts (so the grid and the batch differ);
- prefill attention: a prompt's rows unchunked, and cut into chunks of 7, 128 and 1 tokens next
  to other prompts;
- whole steps through ``GpuRunner``: one request's logits alone and among others, with its
  prompt chunked, decode included.

float16 and float32 only: the interpreter computes bfloat16 dots wrongly (the GPU script,
``benchmarks/gpu_batch_invariant.py``, checks bfloat16 on the device).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pdinfer.layers import triton_ops  # noqa: E402
from pdinfer.layers.attention import triton_paged as tp  # noqa: E402
from pdinfer.layers.triton_gemm import BatchInvariantLinear, bi_matmul, gemm_config  # noqa: E402

if not triton_ops.HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs Triton's interpreter", allow_module_level=True)

from test_triton_kernels import padded_tables, ref_attention, rel_err  # noqa: E402  (also fixes the interpreter)

KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 32, 16, 600


def _interpreter_dot_rounds_rows_alike() -> bool:
    """The interpreter computes ``tl.dot`` with ``np.matmul``. Some BLAS builds round a row of
    a product differently by the row's position in the tile (OpenBLAS's Haswell kernels on an
    AMD EPYC do, for 40 of 64 rows; its SkylakeX kernels do not). Then a dot-based kernel's row
    differs by where the row sits, on the CPU only, and these tests would judge numpy's BLAS
    instead of the kernel (the GPU script checks the kernels on the device either way)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((128, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64)).astype(np.float32).T
    full = np.matmul(a, b, dtype=np.float32)
    for i in range(64):
        alone = np.zeros_like(a)
        alone[0] = a[i]
        if not np.array_equal(full[i], np.matmul(alone, b, dtype=np.float32)[0]):
            return False
    return True


needs_row_stable_dot = pytest.mark.skipif(
    not _interpreter_dot_rounds_rows_alike(),
    reason="this machine's numpy BLAS rounds a row by its position in a tile, so Triton's interpreter "
    "cannot show a dot-based kernel's batch invariance here (benchmarks/gpu_batch_invariant.py checks it on a GPU)",
)


# --- the GEMM ----------------------------------------------------------------------------------
@needs_row_stable_dot
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "k", "num_sms"), [(96, 200, 132), (260, 128, 1)])  # 64- and 128-column tiles
def test_gemm_rows_do_not_depend_on_the_row_count(dtype, n, k, num_sms):
    g = torch.Generator().manual_seed(n)
    weight = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(64, k, generator=g).to(dtype)
    full = bi_matmul(x, weight, bias, num_sms)
    alone = torch.cat([bi_matmul(x[i : i + 1], weight, bias, num_sms) for i in range(64)])
    assert torch.equal(full, alone)
    for m in (1, 3, 17):
        assert torch.equal(bi_matmul(x[:m], weight, bias, num_sms), full[:m]), m
        # the same rows elsewhere in a larger call: another row tile, other neighbours
        assert torch.equal(bi_matmul(torch.cat([x[m:], x[:m]]), weight, bias, num_sms)[-m:], full[:m]), m
    ref = x.double() @ weight.double().T + bias.double()
    assert rel_err(full, ref) < (1e-6 if dtype == torch.float32 else 1e-3)


def test_gemm_config_depends_on_the_weight_only():
    assert gemm_config(4096, 4096, 132).block_n == 64  # 32 column tiles: narrower, to fill the device
    assert gemm_config(28672, 4096, 132).block_n == 128
    assert gemm_config(4096, 4096, 132).block_m == gemm_config(28672, 14336, 132).block_m == 128


def test_linear_module_shares_the_parameters():
    lin = torch.nn.Linear(40, 24)
    bi = BatchInvariantLinear(lin.weight, lin.bias, 132)
    assert bi.weight is lin.weight and bi.bias is lin.bias
    x = torch.randn(2, 5, 40)
    with torch.no_grad():
        assert rel_err(bi(x), lin(x)) < 1e-6


# --- attention ---------------------------------------------------------------------------------
def make_layer(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(NUM_BLOCKS, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    return kv[:, 1]


def tables_for(context_lens: list[int], seed: int) -> list[list[int]]:
    free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    for ctx in context_lens:
        n = -(-ctx // BLOCK_SIZE)
        out.append(free[:n])
        free = free[n:]
    return out


def decode(q, layer, tables, ctx, batch_invariant=True):
    splits = (
        tp.batch_invariant_splits(max(ctx)) if batch_invariant else tp.decode_num_splits(len(ctx), KV_HEADS, max(ctx))
    )
    return tp.decode_attention(
        q, layer, padded_tables(tables), torch.tensor(ctx), HEAD_DIM**-0.5, splits, batch_invariant=batch_invariant
    )


@pytest.fixture
def short_splits(monkeypatch):
    """Splits of 128 tokens (two key tiles), so that contexts of a few hundred tokens have
    several, and the longest (over 128 * BI_MAX_SPLITS) have the capped count."""
    monkeypatch.setattr(tp, "BI_SPLIT_TOKENS", 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_row_alone_equals_the_row_in_any_batch(short_splits, dtype):
    layer = make_layer(dtype)
    g = torch.Generator().manual_seed(1)
    target_ctx, num_heads = 700, 4  # 6 splits; its batches launch more programs (up to the cap)
    q_target = torch.randn(1, num_heads, HEAD_DIM, generator=g).to(dtype)
    table = tables_for([target_ctx], seed=2)[0]
    alone = decode(q_target, layer, [table], [target_ctx])
    ref = ref_attention(q_target.float(), layer.float(), table, target_ctx, [target_ctx - 1], HEAD_DIM**-0.5)
    assert rel_err(alone, ref) < (1e-5 if dtype == torch.float32 else 2e-3)
    for others in ([7, 2100], [1, 2, 3, 1000, 0, 5, 260], [700]):  # longer (more splits, past the cap) and shorter
        contexts = others[: len(others) // 2] + [target_ctx] + others[len(others) // 2 :]
        where = len(others) // 2
        tables = tables_for(contexts, seed=len(contexts))
        tables[where] = table
        q = torch.randn(len(contexts), num_heads, HEAD_DIM, generator=g).to(dtype)
        q[where] = q_target[0]
        out = decode(q, layer, tables, contexts)
        assert torch.equal(out[where], alone[0]), contexts
        for i, ctx in enumerate(contexts):
            if ctx:
                ref = ref_attention(q[i : i + 1].float(), layer.float(), tables[i], ctx, [ctx - 1], HEAD_DIM**-0.5)
                assert rel_err(out[i : i + 1], ref) < (1e-5 if dtype == torch.float32 else 2e-3), (contexts, i)


def prefill_meta(query_lens, context_lens, tables):
    qstart = [0]
    for n in query_lens:
        qstart.append(qstart[-1] + n)
    tiles = [-(-n // tp.PREFILL_BLOCK_M) for n in query_lens]
    work_seq = [s for s, n in enumerate(tiles) for _ in range(n)]
    work_tile = [t for n in tiles for t in range(n)]
    return tp.GpuAttentionMetadata(
        False,
        torch.zeros(0, dtype=torch.int64),
        padded_tables(tables),
        torch.tensor(context_lens),
        query_start=torch.tensor(qstart),
        work_seq=torch.tensor(work_seq),
        work_tile=torch.tensor(work_tile),
        num_work=len(work_seq),
        batch_invariant=True,
    ), qstart


@needs_row_stable_dot
def test_prefill_rows_do_not_depend_on_chunks_or_neighbours():
    layer = make_layer()
    g = torch.Generator().manual_seed(3)
    prompt_len = 300
    table = tables_for([prompt_len], seed=4)[0]
    q_all = torch.randn(prompt_len, 4, HEAD_DIM, generator=g)
    meta, _ = prefill_meta([prompt_len], [prompt_len], [table])
    whole = tp.prefill_attention(q_all, layer, meta, HEAD_DIM**-0.5)
    ref = ref_attention(q_all, layer, table, prompt_len, list(range(prompt_len)), HEAD_DIM**-0.5)
    assert rel_err(whole, ref) < 1e-5
    other_tables = tables_for([30, 140], seed=5)
    for cuts in ([7, 200, 93], [128, 171, 1], [299, 1]):
        start = 0
        for i, n in enumerate(cuts):
            # the chunk among other prompts (one before it, one after) that share its launch
            others = [(30, 30), (140 - i, 140)]
            qlens = [others[0][0], n, others[1][0]]
            ctxs = [others[0][1], start + n, others[1][1]]
            meta, qstart = prefill_meta(qlens, ctxs, [other_tables[0], table, other_tables[1]])
            q = torch.randn(qstart[-1], 4, HEAD_DIM, generator=g)
            q[qstart[1] : qstart[2]] = q_all[start : start + n]
            out = tp.prefill_attention(q, layer, meta, HEAD_DIM**-0.5)
            assert torch.equal(out[qstart[1] : qstart[2]], whole[start : start + n]), (cuts, i)
            start += n


# --- whole steps through the CUDA step path (GpuRunner), on the CPU --------------------------------
def _bi_runner():
    """A tiny float32 Llama on the CUDA step path in the batch-invariant mode: its ``nn.Linear``s
    become the Triton GEMM."""
    from dataclasses import replace

    from pdinfer.config import EngineArgs
    from pdinfer.layers.triton_gemm import BatchInvariantLinear
    from pdinfer.models.spec import ModelSpec
    from pdinfer.worker.gpu_runner import GpuRunner

    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": 96,
        "max_position_embeddings": 256,
    }
    spec = ModelSpec.from_hf_config(config)
    options = replace(EngineArgs().runner_options, batch_invariant=True)
    runner = GpuRunner(spec, "", "dummy", torch.float32, torch.device("cpu"), options, seed=3)
    assert isinstance(runner.model.layers[0].mlp.down_proj, BatchInvariantLinear)
    runner.init_cache(num_blocks=64, block_size=16)
    logits: list[torch.Tensor] = []
    compute_logits = runner.model.compute_logits

    def recording(hidden):
        out = compute_logits(hidden)
        logits.append(out.clone())
        return out

    runner.model.compute_logits = recording
    return runner, logits


def _step(step_id, seqs, prompt):
    """seqs: (token ids, first position, block table, whether this chunk is sampled)."""
    from pdinfer.worker.step_input import SampleSpec, StepInput

    ids, positions, qlens, ctxs, samples, rows = [], [], [], [], [], 0
    for tokens, start, _, sampled in seqs:
        ids += tokens
        positions += range(start, start + len(tokens))
        qlens.append(len(tokens))
        ctxs.append(start + len(tokens))
        rows += len(tokens)
        if sampled:
            samples.append(SampleSpec(row=rows - 1, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0))
    return StepInput(
        step_id=step_id,
        is_prompt=prompt,
        input_ids=ids,
        positions=positions,
        query_lens=qlens,
        context_lens=ctxs,
        block_tables=[table for _, _, table, _ in seqs],
        samples=samples,
    )


@needs_row_stable_dot
def test_a_requests_logits_alone_equal_its_logits_among_others_with_its_prompt_chunked():
    g = torch.Generator().manual_seed(5)
    # a prompt of 150 tokens (over one key tile of either kernel), then 4 decode inputs
    tokens = torch.randint(0, 96, (154,), generator=g).tolist()
    others = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 5, 30)]
    target_table = [17, 3, 40, 9, 22, 8, 31, 50, 12, 60]

    alone, alone_logits = _bi_runner()
    steps = [_step(0, [(tokens[:150], 0, target_table, True)], True)]
    steps += [_step(i, [(tokens[149 + i : 150 + i], 149 + i, target_table, True)], False) for i in range(1, 5)]
    for inp in steps:
        alone.execute(inp).wait()
    # one row a step: the last prompt position, then four decode positions
    reference = [rows[0] for rows in alone_logits]

    mixed, mixed_logits = _bi_runner()
    tables = [[1], [6], [10, 4, 2]]
    table = [20, 21, 23, 24, 25, 26, 27, 30, 33, 35]
    prompt_steps = [
        [(others[0], 0, tables[0], True), (tokens[:100], 0, table, False), (others[1], 0, tables[1], True)],
        [(tokens[100:149], 100, table, False), (others[2][:29], 0, tables[2], False)],
        [(others[2][29:], 29, tables[2], True), (tokens[149:150], 149, table, True)],  # one-token chunks
    ]
    for i, seqs in enumerate(prompt_steps):
        mixed.execute(_step(i, seqs, True)).wait()
    found = [mixed_logits[-1][1]]
    for i in range(1, 5):  # decode among the others, whose contexts are longer and shorter
        seqs = [
            (others[0][:1], 8 + i, tables[0], True),
            (tokens[149 + i : 150 + i], 149 + i, table, True),
            (others[2][:1], 29 + i, tables[2], True),
        ]
        mixed.execute(_step(2 + i, seqs, False)).wait()
        found.append(mixed_logits[-1][1])
    for position, (ref, got) in enumerate(zip(reference, found), start=149):
        assert torch.equal(ref, got), f"position {position}"

"""Multi-head latent attention on CUDA (``triton_mla``), run on the CPU by Triton's interpreter.

- The latent write and the absorbed decode kernel against a float64 reference over random latent
  caches with scrambled block tables: contexts across block edges, several head counts (one
  head group, a padded one, two groups), flash-decoding splits, CUDA-graph padding rows.
- The whole Triton backend (W_UK absorption, the kernel, W_UV; the prefill that decompresses
  the gathered context into the dense prefill kernel) against the CPU backend ``mla``, decode
  and a chunked prefill over a cached prefix, with the metadata ``GpuInputBuilder`` packs.
- Whole engine steps of a tiny random DeepSeek-V3 checkpoint (built by transformers) through
  ``GpuRunner`` against ``CpuRunner``: tokens equal, log-probs close.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pdinfer.layers import triton_ops  # noqa: E402
from pdinfer.layers.attention import triton_mla as tm  # noqa: E402
from pdinfer.layers.attention.mla import MLAPagedAttention, build_mla_metadata  # noqa: E402
from pdinfer.worker.gpu_input import GpuInputBuilder  # noqa: E402
from pdinfer.worker.step_input import SampleSpec, StepInput  # noqa: E402

if not triton_ops.HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs Triton's interpreter", allow_module_level=True)

from test_triton_kernels import _fix_interpreter_scalars, rel_err  # noqa: E402

_fix_interpreter_scalars()

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE = 40, 2, 16
LATENT, ROPE, NOPE, V_DIM = 48, 8, 16, 24  # not powers of two: the kernels' padding masks count
SCALE = 0.37  # not (nope + rope) ** -0.5: a kernel that drops the scale fails


def make_cache() -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.randn(NUM_BLOCKS, NUM_LAYERS, 1, BLOCK_SIZE, 1, LATENT + ROPE)
    return kv, kv[:, 1]  # the engine's tensor and one layer's (strided) view


def scrambled_tables(context_lens: list[int], seed: int = 0) -> list[list[int]]:
    free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for ctx in context_lens:
        n = -(-ctx // BLOCK_SIZE)
        tables.append(free[:n])
        free = free[n:]
    return tables


def padded_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(t) for t in tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)


def ref_decode(q_latent, q_rope, layer, table, ctx, scale):
    """The weighted latent sum [H, latent] of one sequence, in float64."""
    vectors = layer[torch.tensor(table)][:, 0, :, 0].reshape(-1, LATENT + ROPE)[:ctx].double()
    scores = (q_latent.double() @ vectors[:, :LATENT].T + q_rope.double() @ vectors[:, LATENT:].T) * scale
    return scores.softmax(-1) @ vectors[:, :LATENT]


def test_write_latent_skips_padding_slots():
    kv, layer = make_cache()
    before = kv.clone()
    entries = torch.randn(3, LATENT + ROPE)
    tm.write_latent(entries, layer, torch.tensor([5 * BLOCK_SIZE + 2, -1, 17 * BLOCK_SIZE]))
    assert torch.equal(layer[5, 0, 2, 0], entries[0]) and torch.equal(layer[17, 0, 0, 0], entries[2])
    before[5, 1, 0, 2, 0], before[17, 1, 0, 0, 0] = entries[0], entries[2]
    assert torch.equal(kv, before)  # nothing else written (the other layer included)


@pytest.mark.parametrize(("num_heads", "num_splits"), [(4, 1), (16, 4), (20, 2)])  # 20: two head groups
def test_decode_kernel_matches_float64_reference(num_heads, num_splits):
    _, layer = make_cache()
    context_lens = [1, 15, 16, 17, 100, 0]  # across block edges; 0: a CUDA-graph padding row
    tables = scrambled_tables(context_lens)
    q_latent, q_rope = torch.randn(6, num_heads, LATENT), torch.randn(6, num_heads, ROPE)
    out = tm.mla_decode_attention(
        q_latent, q_rope, layer, padded_tables(tables), torch.tensor(context_lens), SCALE, num_splits
    )
    for i, ctx in enumerate(context_lens):
        if ctx == 0:
            assert torch.all(out[i] == 0)
            continue
        ref = ref_decode(q_latent[i], q_rope[i], layer, tables[i], ctx, SCALE)
        assert rel_err(out[i], ref) < 1e-5, (i, ctx)


# --- the backend: absorbed decode and decompressing prefill, against the CPU backend ---------------
NUM_HEADS = 4


def _backends():
    args = (NUM_HEADS, LATENT, NOPE, V_DIM, SCALE)
    weight = torch.randn(NUM_HEADS * (NOPE + V_DIM), LATENT) * LATENT**-0.5
    return MLAPagedAttention(*args), tm.TritonMLAttention(*args), weight


def _step(query_lens, context_lens, tables, is_prompt) -> StepInput:
    positions = [p for q, c in zip(query_lens, context_lens) for p in range(c - q, c)]
    return StepInput(0, is_prompt, [0] * len(positions), positions, query_lens, context_lens, tables)


def _run_both(inp: StepInput, kv: torch.Tensor):
    """The CPU and the Triton backend on copies of ``kv``: (outputs, caches)."""
    cpu, gpu, weight = _backends()
    t = inp.num_tokens
    gen = torch.Generator().manual_seed(5)
    q_nope, q_rope = torch.randn(t, NUM_HEADS, NOPE, generator=gen), torch.randn(t, NUM_HEADS, ROPE, generator=gen)
    entries = torch.randn(t, LATENT + ROPE, generator=gen)
    kv_cpu, kv_gpu = kv.clone(), kv.clone()
    ref = cpu.forward(q_nope, q_rope, entries, weight, kv_cpu[:, 1], build_mla_metadata(inp, kv_cpu))
    step = GpuInputBuilder(BLOCK_SIZE, 64, tm.mla_decode_programs(NUM_HEADS), kv.device, latent_cache=True).build(inp)
    out = gpu.forward(q_nope, q_rope, entries, weight, kv_gpu[:, 1], step.meta)
    return (out, ref), (kv_gpu, kv_cpu)


def test_backend_decode_matches_cpu_backend():
    kv, _ = make_cache()
    context_lens = [1, 17, 40]
    tables = scrambled_tables(context_lens, seed=1)
    (out, ref), (kv_gpu, kv_cpu) = _run_both(_step([1, 1, 1], context_lens, tables, False), kv)
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(kv_gpu, kv_cpu)  # each new latent in its slot, nothing else touched


def test_backend_prefill_with_cached_prefix_matches_cpu_backend():
    kv, _ = make_cache()
    # sequences 1, 2 and 4 continue a cached prefix (chunked prefill); 3 spans two query tiles;
    # 4's prefix is longer than a key tile (keys its queries all see, without the causal mask)
    query_lens = [7, 20, 1, 150, 5]
    context_lens = [7, 50, 18, 160, 90]
    tables = scrambled_tables(context_lens, seed=2)
    (out, ref), (kv_gpu, kv_cpu) = _run_both(_step(query_lens, context_lens, tables, True), kv)
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(kv_gpu, kv_cpu)


# --- whole steps of a tiny DeepSeek-V3 through the CUDA step path, on the CPU -----------------------
VOCAB = 128


@pytest.fixture(scope="module")
def deepseek_folder(tmp_path_factory):
    import transformers

    cfg = transformers.DeepseekV3Config(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # initialised to 1: make them matter
                param.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("deepseek-v3")
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def _runner(folder: str, gpu: bool = False):
    import json

    from pdinfer.config import EngineArgs
    from pdinfer.models.spec import ModelSpec
    from pdinfer.worker.cpu_runner import CpuRunner
    from pdinfer.worker.gpu_runner import GpuRunner

    with open(os.path.join(folder, "config.json")) as f:
        spec = ModelSpec.from_hf_config(json.load(f))
    runner_class = GpuRunner if gpu else CpuRunner  # GpuRunner: the CUDA step path on CPU tensors
    return runner_class(spec, folder, "auto", torch.float32, torch.device("cpu"), EngineArgs().runner_options)


def _sample(row: int, position: int) -> SampleSpec:
    return SampleSpec(
        row=row, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=position, logprobs=VOCAB
    )


def _by_token(result) -> list[dict[int, float]]:
    return [dict(zip(ids, lps)) for ids, lps in zip(result.top_ids, result.top_logprobs)]


def test_gpu_step_path_runs_deepseek_like_the_cpu_runner(deepseek_folder):
    cpu, gpu = _runner(deepseek_folder), _runner(deepseek_folder, gpu=True)
    for r in (cpu, gpu):
        r.init_cache(num_blocks=24, block_size=4)
    tables = [[7, 2, 9], [11, 4, 20, 1, 5, 6], [8, 3, 12]]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 9)]
    lens = [5, 17, 6]  # the third prompt's first chunk
    prefill = StepInput(
        step_id=0,
        is_prompt=True,
        input_ids=[t for p, n in zip(prompts, lens) for t in p[:n]],
        positions=[i for n in lens for i in range(n)],
        query_lens=lens,
        context_lens=lens,
        block_tables=tables,
        samples=[_sample(4, 5), _sample(21, 17)],
        prompt_rows=[0, 1, 2, 3],
        prompt_targets=prompts[0][1:5],
    )
    chunk = StepInput(  # the rest of the third prompt over its cached chunk
        step_id=1,
        is_prompt=True,
        input_ids=prompts[2][6:],
        positions=[6, 7, 8],
        query_lens=[3],
        context_lens=[9],
        block_tables=[tables[2]],
        samples=[_sample(2, 9)],
    )
    decode = StepInput(  # all three; two tokens still pending (sampled by steps 0 and 1)
        step_id=2,
        is_prompt=False,
        input_ids=[-1, 42, -1],
        positions=[5, 17, 9],
        query_lens=[1, 1, 1],
        context_lens=[6, 18, 10],
        block_tables=tables,
        samples=[_sample(0, 6), _sample(1, 18), _sample(2, 10)],
        pending=[(0, 0, 0), (2, 1, 0)],
    )
    for inp in (prefill, chunk, decode):
        ref = cpu.execute(inp)
        out = gpu.execute(inp).wait()
        assert out.token_ids == ref.token_ids, inp.step_id
        for got, want in zip(_by_token(out), _by_token(ref)):
            assert got.keys() == want.keys()
            assert [got[i] for i in want] == pytest.approx(list(want.values()), abs=1e-4), inp.step_id
        if inp.prompt_rows:
            assert out.prompt_logprobs == pytest.approx(ref.prompt_logprobs, abs=1e-4)
    assert rel_err(gpu.cache.kv, cpu.cache.kv) < 1e-5  # every latent written in the same place

"""Qwen3-MoE and DeepSeek-V2/V3 equal transformers on tiny random-weight checkpoints.

Each case builds a model with transformers (8 routed experts, top-2; hidden 64; vocab 256),
saves it as float32 safetensors and compares pdinfer's greedy tokens and log-probabilities with
transformers' own ``generate()`` on the same weights: a mixed batch, chunked prefill in several
chunks per prompt, a prefix-cache hit, blocks loaded from the KV store and a PE -> CE
hand-off (for DeepSeek, the store and the hand-off carry the latent cache). The weights are
drawn wide (``initializer_range`` 0.2, norms and biases perturbed, the V3 correction bias as
large as the sigmoid scores' spread) so that routing, groups and the bias all decide something
and the greedy tokens are far from flat.
"""

from __future__ import annotations

import pytest
import torch

from pdinfer import LLM, EngineArgs, SamplingParams
from pdinfer.engine.completion_engine import CompletionEngine
from pdinfer.engine.pd_pair import PDPair
from pdinfer.engine.prefill_engine import PrefillEngine
from pdinfer.models.presets import PRESETS
from pdinfer.models.spec import ModelSpec

VOCAB = 256
NEW_TOKENS = 12
PROMPT_LENS = (5, 23, 70, 130)  # mixed; two longer than the V2 case's 64-token original context
MAX_REL_ERR = 1e-4
NUM_LOGPROBS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS)

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_experts_per_tok=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,  # nothing for generate() to stop at (or, with min_new_tokens, to mask)
    tie_word_embeddings=False,
)
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8)
CASES = {
    # softmax top-2 renormalized; layer 1 dense (mlp_only_layers)
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # softmax, group-limited greedy (both experts from the one group with the best expert:
    # with top_k <= topk_group the groups could not change the choice), plain q_proj,
    # YaRN with mscale (the softmax scale changes), 2 shared experts, layer 0 dense
    "deepseek-v2": (
        "DeepseekV2Config",
        dict(
            **MLA,
            num_hidden_layers=2,
            q_lora_rank=None,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=1,
            routed_scaling_factor=1.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
    # sigmoid with the correction bias, best 2 of 4 groups by their top-2 sum, q through its
    # low-rank path, interleaved rope, renormalized and scaled weights, layer 0 dense
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            **MLA,
            num_hidden_layers=2,
            q_lora_rank=48,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
    ),
}


class Case:
    """A saved checkpoint, its transformers model and the reference continuations."""

    def __init__(self, name: str, folder):
        import transformers

        config_name, overrides = CASES[name]
        cfg = getattr(transformers, config_name)(**SMALL, **overrides)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" in param_name:  # initialised to 1: make them matter
                    param.uniform_(0.5, 1.5)
                elif param_name.endswith("bias"):
                    param.normal_(0.0, 0.5)
            for buffer_name, buffer in model.named_buffers():
                if buffer_name.endswith("e_score_correction_bias"):  # zeros (a buffer): make it choose
                    buffer.normal_(0.0, 0.3)
        model.save_pretrained(folder, safe_serialization=True)
        self.name, self.folder, self.model = name, str(folder), model.eval()
        self._refs: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    def reference(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        """transformers' greedy ``generate()``: the new tokens and each step's log-softmax."""
        key = tuple(prompt)
        if key not in self._refs:
            with torch.no_grad():
                out = self.model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    return_dict_in_generate=True,
                    output_logits=True,
                )
            logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
            self._refs[key] = (out.sequences[0, len(prompt) :].tolist(), logprobs)
        return self._refs[key]

    def check(self, prompts: list[list[int]], outputs, where: str) -> None:
        for prompt, out in zip(prompts, outputs):
            assert out.error is None, f"{where}: {out.error}"
            ref_tokens, ref_logprobs = self.reference(prompt)
            got = out.outputs[0]
            assert got.token_ids == ref_tokens, f"{self.name}, {where}, prompt of {len(prompt)} tokens"
            if got.logprobs is None:  # a P/D hand-off: tokens only
                continue
            for step, top in enumerate(got.logprobs):
                ids = torch.tensor(list(top))
                ours, ref = torch.tensor(list(top.values())), ref_logprobs[step, ids]
                err = float((ours - ref).norm() / ref.norm())
                assert err < MAX_REL_ERR, (
                    f"{self.name}, {where}, prompt of {len(prompt)}: step {step} rel err {err:.1e}"
                )


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def _prompts(lengths, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _all_free(*engines) -> None:
    for engine in engines:
        assert engine.get_num_free_blocks() == engine.num_blocks, f"{engine.name} leaked KV blocks"


def test_mixed_batch_matches_transformers(case):
    llm = LLM(model=case.folder, num_kv_blocks=64)
    assert llm.engine.spec.architecture == case.model.config.architectures[0]
    prompts = _prompts(PROMPT_LENS)
    outputs = _generate(llm, prompts)
    case.check(prompts, outputs, "mixed batch")
    tokens = [t for out in outputs for t in out.outputs[0].token_ids]
    assert len(set(tokens)) > len(tokens) // 3, f"degenerate greedy output: {tokens}"
    _all_free(llm.engine)


def test_chunked_prefill_matches_transformers(case):
    llm = LLM(model=case.folder, num_kv_blocks=64, chunked_prefill=True, max_num_batched_tokens=24)
    prompts = _prompts(PROMPT_LENS)  # up to 6 chunks per prompt
    case.check(prompts, _generate(llm, prompts), "chunked prefill")
    _all_free(llm.engine)


def test_prefix_cache_hit_matches_transformers(case):
    llm = LLM(model=case.folder, num_kv_blocks=64)
    prefix = _prompts((48,), seed=2)[0]
    first, second = (prefix + tail for tail in _prompts((5, 9), seed=3))
    out_first = _generate(llm, [first])
    out_second = _generate(llm, [second])
    assert out_first[0].metrics.num_cached_tokens == 0
    assert out_second[0].metrics.num_cached_tokens == 48  # three full blocks read from the cache
    case.check([first, second], out_first + out_second, "prefix-cache hit")
    _all_free(llm.engine)


def test_kv_store_load_matches_transformers(case, tmp_path):
    """A second engine loads the first one's stored blocks (for DeepSeek: latent blocks)."""
    prompts = _prompts(PROMPT_LENS)
    writer = LLM(model=case.folder, num_kv_blocks=64, kv_store=str(tmp_path))
    _generate(writer, prompts)
    assert writer.engine.kv_store is not None and writer.engine.kv_store.flush(60)  # saves run in the background
    writer.engine.shutdown()
    reader = LLM(model=case.folder, num_kv_blocks=64, kv_store=str(tmp_path))
    outputs = _generate(reader, prompts)
    block = reader.engine.cache_config.block_size
    # the full blocks before each prompt's last token are loaded instead of recomputed
    assert [o.metrics.num_cached_tokens for o in outputs] == [(n - 1) // block * block for n in PROMPT_LENS]
    case.check(prompts, outputs, "KV store load")
    _all_free(reader.engine)
    reader.engine.shutdown()


def test_pd_handoff_matches_transformers(case):
    """A PE prefills and pushes its blocks over TCP; the CE decodes from them. For DeepSeek the
    blocks hold the latent cache: one vector of kv_lora_rank + qk_rope_head_dim per token."""
    pe = PrefillEngine(EngineArgs(model=case.folder, engine_type="prompt", num_kv_blocks=64))
    ce = CompletionEngine(EngineArgs(model=case.folder, engine_type="completion", num_kv_blocks=64))
    try:
        spec, cache = ce.spec, ce.model_runner.require_cache()
        block_size = ce.cache_config.block_size
        if spec.mla is not None:
            latent = spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
            assert cache.block_shape == (spec.num_layers, 1, block_size, 1, latent)
            assert cache.bytes_per_block == spec.num_layers * block_size * latent * 4
        prompts = _prompts(PROMPT_LENS)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        case.check(prompts, PDPair(pe, ce).generate([{"prompt_token_ids": p} for p in prompts], params), "P/D")
        num_blocks = sum(-(-len(p) // block_size) for p in prompts)
        assert pe.role.handoff_stats["bytes"] == num_blocks * cache.bytes_per_block
        _all_free(pe, ce)
    finally:
        pe.shutdown()
        ce.shutdown()


def test_dummy_weights_run(tmp_path):
    """``load_format="dummy"`` fills every MoE and MLA parameter (correction bias included)."""
    import json

    _, overrides = CASES["deepseek-v3"]
    config = {"architectures": ["DeepseekV3ForCausalLM"], **SMALL, **overrides, "rope_interleave": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(tmp_path), load_format="dummy", num_kv_blocks=16)
    for name, param in llm.engine.model_runner.model.named_parameters():
        assert bool(torch.isfinite(param).all()), name
    out = _generate(llm, _prompts((20,)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_presets():
    qwen = ModelSpec.from_hf_config(PRESETS["qwen3-30b-a3b"])
    assert qwen.moe is not None and (qwen.moe.num_experts, qwen.moe.top_k) == (128, 8)
    assert len(qwen.moe.sparse_layers) == qwen.num_layers == 48
    lite = ModelSpec.from_hf_config(PRESETS["deepseek-v2-lite"])
    assert lite.mla is not None and lite.moe is not None
    assert lite.kv_cache.block_shape(16) == (27, 1, 16, 1, 512 + 64)  # the latent, not K and V
    assert lite.moe.sparse_layers == tuple(range(1, 27))

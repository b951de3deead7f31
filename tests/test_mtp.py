"""The MTP drafter (DeepSeek-V3's multi-token prediction, issue 28) on tiny random checkpoints.

transformers' DeepseekV3 drops the MTP layer, so each checkpoint is a tiny random DeepseekV3
saved by transformers, plus the tensors of one MTP layer under the checkpoint's own names
(``model.layers.{N}.enorm/hnorm/eh_proj/shared_head.*`` and a decoder block's), with
``num_nextn_predict_layers=1``. The reference MTP is written here from the formula, with
transformers' own DeepseekV3 decoder layer as the block and transformers' main model for the
hidden states:

    h'_i = block(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])),  logits = head(norm(h'_i))

and drafts chain k steps, step j reading h' of step j - 1 and draft j.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_blocks_back
from safetensors.torch import load_file, save_file

from pdinfer import LLM, EngineArgs, SamplingParams, env
from pdinfer.engine.completion_engine import CompletionEngine
from pdinfer.engine.pd_pair import PDPair
from pdinfer.engine.prefill_engine import PrefillEngine
from pdinfer.sequence import Sequence

VOCAB = 256
K = 3
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
    eos_token_id=None,
    tie_word_embeddings=False,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    q_lora_rank=48,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _perturb(named) -> None:
    """Norms and biases away from 1 and 0, the V3 correction bias choosing (as test_moe_models)."""
    with torch.no_grad():
        for name, tensor in named:
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.3)
            elif name.endswith("bias"):
                tensor.normal_(0.0, 0.5)


class MTPCase:
    """A DeepseekV3 checkpoint with one MTP layer, and the reference MTP in plain torch.

    ``bigram``: one MoE layer whose attention output is zeroed (each position's logits depend on
    its own token only), embedding rows of RMS 1, and an MTP layer that copies it and reads only
    the next token's embedding (eh_proj = [I | 0], enorm 1, shared head = final norm + lm_head):
    its h' at position i is the main model's at i + 1, so its greedy drafts are the main
    model's greedy tokens."""

    def __init__(self, folder, bigram: bool = False):
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

        layers = 1 if bigram else 2
        cfg = DeepseekV3Config(**SMALL, num_hidden_layers=layers, first_k_dense_replace=0 if bigram else 1)
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(cfg).float().eval()
        _perturb(list(model.named_parameters()) + list(model.named_buffers()))
        hidden = cfg.hidden_size
        block = DeepseekV3DecoderLayer(cfg, layer_idx=layers).float().eval()  # MoE (past the dense layers)
        # A layer made alone leaves its experts as torch.empty: garbage (NaN at times) in a long test run.
        block.apply(model._init_weights)
        with torch.no_grad():
            if bigram:
                model.model.layers[0].self_attn.o_proj.weight.zero_()
                embed = model.model.embed_tokens.weight
                embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt())
                block.load_state_dict(model.model.layers[0].state_dict())
                own = {
                    "enorm.weight": torch.ones(hidden),
                    "hnorm.weight": torch.ones(hidden),
                    "eh_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
                    "shared_head.norm.weight": model.model.norm.weight.clone(),
                    "shared_head.head.weight": model.lm_head.weight.clone(),
                }
            else:
                _perturb(list(block.named_parameters()) + list(block.named_buffers()))
                gen = torch.Generator().manual_seed(1)
                own = {
                    "enorm.weight": torch.rand(hidden, generator=gen) + 0.5,
                    "hnorm.weight": torch.rand(hidden, generator=gen) + 0.5,
                    "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * 0.2,
                    "shared_head.norm.weight": torch.rand(hidden, generator=gen) + 0.5,
                    "shared_head.head.weight": torch.randn(VOCAB, hidden, generator=gen) * 0.2,
                }
        model.save_pretrained(folder, safe_serialization=True)
        file = folder / "model.safetensors"
        tensors = load_file(str(file))
        mtp = {**{f"{k}": v for k, v in block.state_dict().items()}, **own}
        mtp["embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()  # V3 keeps a copy
        tensors.update({f"model.layers.{layers}.{k}": v.detach().clone().contiguous() for k, v in mtp.items()})
        save_file(tensors, str(file), metadata={"format": "pt"})
        config = json.loads((folder / "config.json").read_text())
        config["num_nextn_predict_layers"] = 1
        (folder / "config.json").write_text(json.dumps(config))
        self.folder, self.model, self.block, self.own, self.eps = str(folder), model, block, own, cfg.rms_norm_eps

    @torch.no_grad()
    def main_hidden(self, tokens: list[int]) -> torch.Tensor:
        """transformers' last-layer output (before the final norm) at every position."""
        seen = []
        hook = self.model.model.layers[-1].register_forward_hook(lambda m, i, out: seen.append(out))
        self.model(torch.tensor([tokens]))
        hook.remove()
        out = seen[0]
        return (out[0] if isinstance(out, tuple) else out)[0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int, start: int = 0) -> tuple[list[int], list[torch.Tensor]]:
        """The reference MTP's k greedy drafts after ``tokens`` and each step's logits; the MTP
        context starts at position ``start``."""
        last = len(tokens) - 1
        h = self.model.model.norm(self.main_hidden(tokens[:last]))[start:]  # h_i, i in [start, last)
        nexts = list(tokens[start + 1 : last + 1])
        drafts, logits = [], []
        for _ in range(k):
            embeds = self.model.model.embed_tokens(torch.tensor(nexts))
            x = torch.cat(
                [_rms(embeds, self.own["enorm.weight"], self.eps), _rms(h, self.own["hnorm.weight"], self.eps)], -1
            )
            x = (x @ self.own["eh_proj.weight"].T)[None]
            n = x.shape[1]
            positions = torch.arange(start, start + n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            rope = self.model.model.rotary_emb(x, positions)
            out = self.block(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
            out = (out[0] if isinstance(out, tuple) else out)[0, -1]
            step = _rms(out, self.own["shared_head.norm.weight"], self.eps) @ self.own["shared_head.head.weight"].T
            logits.append(step)
            drafts.append(int(step.argmax()))
            h, nexts = torch.cat([h, out[None]]), nexts + [drafts[-1]]
        return drafts, logits


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> MTPCase:
    return MTPCase(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def bigram(tmp_path_factory) -> MTPCase:
    return MTPCase(tmp_path_factory.mktemp("mtp-bigram"), bigram=True)


def _prompts(lengths, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _llm(case: MTPCase, monkeypatch, zos: bool = True, spec: bool = True, num_blocks: int = 64) -> LLM:
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "1" if zos else "0")
    monkeypatch.delitem(env._role_defaults, "PDINFER_ZERO_OVERHEAD_SCHEDULING", raising=False)
    extra = dict(speculative_method="mtp", num_draft_tokens=K) if spec else {}
    llm = LLM(model=case.folder, num_kv_blocks=num_blocks, **extra)
    assert llm.engine.zero_overhead is zos
    return llm


def _generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def _record_drafts(drafter, logits: list | None = None) -> list[tuple[list[int], list[int]]]:
    """Wrap ``drafter.draft``: every (tokens, drafts) it answers with drafts; with ``logits``,
    each such call's MTP logits go there too (one list per call)."""
    calls: list[tuple[list[int], list[int]]] = []
    inner, inner_logits = drafter.draft, drafter.mtp.compute_logits
    seen: list[torch.Tensor] = []

    def compute_logits(hidden, main):
        seen.append(inner_logits(hidden, main))
        return seen[-1]

    def draft(seq, k):
        seen.clear()
        drafts = inner(seq, k)
        if drafts:
            calls.append((list(seq.token_ids), drafts))
            if logits is not None:
                logits.append(list(seen))
        return drafts

    drafter.draft = draft
    if logits is not None:
        drafter.mtp.compute_logits = compute_logits
    return calls


def _same_logits(got: list[torch.Tensor], ref: list[torch.Tensor]) -> bool:
    return len(got) == len(ref) and all(float((g[0] - r).norm() / r.norm()) < 1e-4 for g, r in zip(got, ref))


# --- the MTP layer against the reference (no scheduler) ---------------------------------------------
def test_mtp_forward_and_drafts_match_reference(case, monkeypatch):
    """The drafter's MTP forward (each chained step's logits) and drafts equal the reference's,
    over two catch-ups (a prompt, then 5 more verified tokens) and a context that starts late."""
    llm = _llm(case, monkeypatch)
    drafter = llm.engine.draft_pool.drafter
    seen_logits: list[torch.Tensor] = []
    inner_logits = drafter.mtp.compute_logits
    monkeypatch.setattr(
        drafter.mtp, "compute_logits", lambda h, main: seen_logits.append(inner_logits(h, main)) or seen_logits[-1]
    )
    tokens = _prompts((40,))[0]
    seq = Sequence("r", tokens[:30], SamplingParams(), seed=0)
    seq.block_table = list(range(40, 40 + 3))  # blocks the idle engine does not use (block size 16)
    hidden = case.main_hidden(tokens)
    for start, end in ((0, 30), (30, 35)):  # tokens[:end] known: hidden rows of positions < end - 1
        seq.token_ids = tokens[:end]
        first = 0 if start == 0 else start - 1
        drafter.observe(seq, first, hidden[first : end - 1])
        seen_logits.clear()
        drafts = drafter.draft(seq, K)
        ref_drafts, ref_logits = case.drafts(tokens[:end], K)
        assert drafts == ref_drafts, f"tokens[:{end}]"
        for got, ref in zip(seen_logits, ref_logits):
            assert float((got[0] - ref).norm() / ref.norm()) < 1e-4
    drafter.forget(seq)
    # a context that starts at position 10 (a prefix-cache hit or a CE), in blocks holding other
    # entries before it: the reference sees the same window
    other = Sequence("s", tokens[:30], SamplingParams(), seed=0)
    other.block_table = list(seq.block_table)
    drafter.observe(other, 10, hidden[10:29])
    seen_logits.clear()
    drafts = drafter.draft(other, K)
    ref_drafts, ref_logits = case.drafts(tokens[:30], K, start=10)
    assert drafts == ref_drafts
    for got, ref in zip(seen_logits, ref_logits):
        assert float((got[0] - ref).norm() / ref.norm()) < 1e-4
    drafter.forget(other)
    assert drafter.num_tracked == 0


def test_hidden_states_past_the_cap_restart_the_context(case, monkeypatch):
    """A sequence that does not draft for long keeps at most ``max_pending_rows`` hidden states;
    its MTP context then starts after the dropped ones (the reference with the same window)."""
    llm = _llm(case, monkeypatch)
    drafter = llm.engine.draft_pool.drafter
    monkeypatch.setattr(drafter, "max_pending_rows", 8)
    tokens = _prompts((21,), seed=5)[0]
    hidden = case.main_hidden(tokens)
    seq = Sequence("r", tokens, SamplingParams(), seed=0)
    seq.block_table = [40, 41]
    for first in range(0, 20, 5):  # rows of positions 0..19 in steps of 5: the cap drops some each time
        drafter.observe(seq, first, hidden[first : first + 5])
    assert drafter.draft(seq, K) == case.drafts(tokens, K, start=12)[0]
    drafter.forget(seq)


def test_sequences_that_do_not_draft_keep_their_context(case, monkeypatch):
    """In a batch too large to draft, a sequence's MTP entries are written in chunks
    (``catch_up``), not dropped past the cap: once the batch shrinks, its drafts are the
    reference's over its whole context."""
    llm = _llm(case, monkeypatch)
    pool, drafter = llm.engine.draft_pool, llm.engine.draft_pool.drafter
    monkeypatch.setattr(pool, "max_batch", 1)  # two sequences: no drafts until one finishes
    monkeypatch.setattr(drafter, "catch_up_rows", 4)
    monkeypatch.setattr(drafter, "max_pending_rows", 16)  # < the 5 + 20 rows waiting otherwise
    logits: list[list[torch.Tensor]] = []
    calls = _record_drafts(drafter, logits)
    prompts = _prompts((5, 12), seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (36, 20)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert calls and all(len(tokens) > 5 + 20 for tokens, _ in calls)  # only after the other finished
    for (tokens, drafts), got in zip(calls, logits):
        ref_drafts, ref_logits = case.drafts(tokens, len(drafts))
        assert drafts == ref_drafts and _same_logits(got, ref_logits), f"after {len(tokens)} tokens"
    assert drafter.num_tracked == 0
    assert_blocks_back(llm.engine)


def test_engine_drafts_are_the_reference_drafts(case, monkeypatch):
    """In the engine (prefill, then verifying steps with rollback), every draft the MTP drafter
    proposed is what the reference MTP proposes after the same tokens."""
    llm = _llm(case, monkeypatch)
    logits: list[list[torch.Tensor]] = []
    calls = _record_drafts(llm.engine.draft_pool.drafter, logits)
    prompts = _prompts((7, 33))
    _generate(llm, prompts)
    assert len(calls) >= 8
    for (tokens, drafts), got in zip(calls, logits):
        ref_drafts, ref_logits = case.drafts(tokens, len(drafts))
        assert drafts == ref_drafts and _same_logits(got, ref_logits), f"after {len(tokens)} tokens"
    assert llm.engine.draft_pool.drafter.num_tracked == 0
    assert_blocks_back(llm.engine)


# --- output equals output without speculation -------------------------------------------------------
@pytest.mark.parametrize(("zos", "num_blocks"), [(True, 64), (False, 64), (True, 9)])
def test_greedy_equals_no_speculation(case, monkeypatch, zos, num_blocks):
    """With and without zero-overhead scheduling; with 9 blocks, sequences are preempted and
    recomputed (their MTP context restarts with their new prefill). A prompt that extends
    another hits the prefix cache (its MTP context starts after the hit)."""
    prompts = _prompts((5, 23, 70))
    prompts.append(prompts[2] + prompts[0])
    expected = _generate(_llm(case, monkeypatch, zos, spec=False), prompts)
    llm = _llm(case, monkeypatch, zos, num_blocks=num_blocks)
    assert _generate(llm, prompts) == expected
    pool = llm.engine.draft_pool
    assert pool.num_drafted_tokens > 0
    assert (llm.engine.scheduler.num_preemptions > 0) == (num_blocks < 64)
    assert pool.drafter.num_tracked == 0
    assert_blocks_back(llm.engine)


def test_seeded_sampling_and_n_equal_no_speculation(case, monkeypatch):
    """Sampled drafts follow the (seed, position)-keyed rule, so seeded outputs, n = 2 forks
    included (whose blocks are copied on write under their MTP entries), equal those without
    speculation."""
    prompts = _prompts((12, 30), seed=7)
    params = SamplingParams(temperature=0.8, top_k=20, seed=11, n=2, max_tokens=16, ignore_eos=True)

    def outputs(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs]

    expected = outputs(_llm(case, monkeypatch, spec=False))
    llm = _llm(case, monkeypatch)
    assert outputs(llm) == expected
    assert llm.engine.draft_pool.num_drafted_tokens > 0
    assert llm.engine.draft_pool.drafter.num_tracked == 0
    assert_blocks_back(llm.engine)


def test_bigram_copy_drafts_are_accepted(bigram, monkeypatch):
    """The MTP layer that copies a bigram model predicts its greedy tokens: (nearly) every draft
    is accepted, and output still equals output without speculation. Exactly 1.0 up to float
    rounding between a 1-row and a (1 + k)-row forward."""
    prompts = _prompts((6, 40), seed=3)
    expected = _generate(_llm(bigram, monkeypatch, spec=False), prompts)
    llm = _llm(bigram, monkeypatch)
    assert _generate(llm, prompts) == expected
    pool = llm.engine.draft_pool
    assert pool.num_drafted_tokens >= 8
    print("bigram copy:", pool.stats())
    assert pool.acceptance_rate > 0.95, pool.stats()
    assert_blocks_back(llm.engine)


def test_pd_pair_drafts_on_the_ce_only(case, monkeypatch):
    """A PE never drafts (no pool, no MTP layer run); the CE drafts from its first decode step on
    (no MTP entries for the prompt) and its output equals NORMAL's."""
    prompts = _prompts((9, 41))
    expected = _generate(_llm(case, monkeypatch, spec=False), prompts)

    def args(role):
        return EngineArgs(
            model=case.folder,
            engine_type=role,
            num_kv_blocks=64,
            speculative_method="mtp",
            num_draft_tokens=K,
            kv_transfer={"connector": "tcp"},
        )

    pe, ce = PrefillEngine(args("prompt")), CompletionEngine(args("completion"))
    try:
        assert pe.draft_pool is None and not pe.model_runner.keep_hidden
        logits: list[list[torch.Tensor]] = []
        calls = _record_drafts(ce.draft_pool.drafter, logits)
        outs = PDPair(pe, ce).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert calls and ce.draft_pool.num_drafted_tokens > 0
        prompt_len = {len(p) for p in prompts}
        for (tokens, drafts), got in list(zip(calls, logits))[:6]:
            start = next(n for n in prompt_len if tokens[:n] in prompts)  # the first decode position
            ref_drafts, ref_logits = case.drafts(tokens, len(drafts), start=start)
            assert drafts == ref_drafts and _same_logits(got, ref_logits)
        assert ce.draft_pool.drafter.num_tracked == 0
        for engine in (pe, ce):
            assert engine.get_num_free_blocks() == engine.num_blocks
    finally:
        pe.shutdown()
        ce.shutdown()


def test_the_mtp_cache_is_counted_in_the_kv_budget(case):
    """The MTP layer's latent cache is one more layer per block: the memory left next to the
    activations buys blocks of 3/2 the main cache's bytes (a model of 2 layers)."""
    budget = 512 << 20
    plain = LLM(model=case.folder, kv_cache_memory=budget).engine
    mtp = LLM(model=case.folder, kv_cache_memory=budget, speculative_method="mtp").engine
    sc = plain.scheduler_config
    room = budget - plain.model_runner.activation_bytes(sc.max_num_batched_tokens, sc.max_num_seqs)
    per_block = plain.model_runner.require_cache().bytes_per_block  # 2 layers of latent vectors
    assert plain.num_blocks == room // per_block
    assert mtp.num_blocks == room // (per_block * 3 // 2)
    assert mtp.draft_pool.drafter.kv.shape[0] == mtp.num_blocks + len(mtp.draft_pool.drafter.scratch)


def test_refusals(case, tmp_path):
    """A DeepSeek-V3 config naming an MTP layer whose tensors transformers dropped is refused."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    DeepseekV3ForCausalLM(DeepseekV3Config(**SMALL, num_hidden_layers=1)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no tensors model.layers.1"):
        LLM(model=str(tmp_path), num_kv_blocks=16, speculative_method="mtp")

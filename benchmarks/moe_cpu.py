"""MoE decoding on the CPU: pdinfer's ``LLM`` against transformers' ``generate`` on tiny random
Qwen3-MoE and DeepSeek-V3 checkpoints (the shapes of tests/test_moe_models.py: hidden 64,
8 routed experts, top-2), float32, greedy, batch 1 and 16, the same prompts; tokens compared.

    python benchmarks/moe_cpu.py [--new-tokens 64] [--prompt-len 32] [--repeats 3] [--threads N]

Prints a table: output tokens per second (best of ``--repeats``) and how many sequences equal
transformers' tokens. The models are tiny, so this measures the per-token overhead of each
stack (scheduling, routing, expert dispatch), not matmul speed. One thread by default: their
ops are too small to split, and on a busy machine the OpenMP pool's waits dominated (2026-12-03,
2-core Xeon at load 6: both stacks 2-10x slower with 2 threads).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_experts_per_tok=2,
    vocab_size=256,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    tie_word_embeddings=False,
)
MODELS = {
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_experts=8, norm_topk_prob=True),
    ),
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=8,
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


def build(name: str, folder: str):
    import transformers

    config_name, overrides = MODELS[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_name)(**SMALL, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # wide weights, so that routing decides something
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model.eval()


def best_rate(run, num_tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    best, tokens = 0.0, []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        best = max(best, num_tokens / (time.perf_counter() - start))
    return best, tokens


def measure(name: str, batch: int, args) -> dict:
    from pdinfer import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as folder:
        model = build(name, folder)
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, 256, (batch, args.prompt_len), generator=gen)
        num_tokens = batch * args.new_tokens

        def reference() -> list[list[int]]:
            with torch.no_grad():
                out = model.generate(prompts, max_new_tokens=args.new_tokens, do_sample=False)
            return out[:, args.prompt_len :].tolist()

        llm = LLM(model=folder, num_kv_blocks=64 * batch, max_num_seqs=batch, num_threads=args.threads)
        torch.set_num_threads(args.threads)  # transformers' too
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        requests = [{"prompt_token_ids": p} for p in prompts.tolist()]

        def ours() -> list[list[int]]:
            return [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]

        ours()  # warm-up: kernels compiled and cached
        reference()
        ours_rate, ours_tokens = best_rate(ours, num_tokens, args.repeats)
        ref_rate, ref_tokens = best_rate(reference, num_tokens, args.repeats)
        equal = sum(a == b for a, b in zip(ours_tokens, ref_tokens))
        return dict(model=name, batch=batch, ours=ours_rate, ref=ref_rate, equal=f"{equal}/{batch}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads, both stacks (1: the tiny shapes gain nothing from more)"
    )
    args = parser.parse_args()
    rows = [measure(name, int(b), args) for name in MODELS for b in args.batches.split(",")]
    print(
        f"\nfloat32, greedy, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, {torch.get_num_threads()} threads"
    )
    print(f"{'model':<12} {'batch':>5} {'pdinfer tok/s':>14} {'transformers tok/s':>19} {'ratio':>6} {'equal':>6}")
    for r in rows:
        print(
            f"{r['model']:<12} {r['batch']:>5} {r['ours']:>14.0f} {r['ref']:>19.0f} "
            f"{r['ours'] / r['ref']:>6.1f} {r['equal']:>6}"
        )


if __name__ == "__main__":
    main()

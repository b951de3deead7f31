"""Speculative decoding on the CPU: acceptance rate and output tok/s with and without it, at
several batch sizes, greedy. Prints a table.

n-gram (default model): a repetitive workload (rewrite a text that is in the prompt) and a
non-repetitive one (open-ended questions). MTP (``--method mtp``): a tiny DeepSeek-V3 with one
MTP layer and dummy (random) weights, on random prompts; random weights accept almost nothing,
so this measures what drafting and verifying cost, not what a trained MTP layer gains.

    PYTHONPATH=. python benchmarks/spec_decode.py [--batch-sizes 1 8 64] [--k 3] [--max-tokens 128]
    PYTHONPATH=. python benchmarks/spec_decode.py --method mtp [--batch-sizes 1 8]

tok/s counts output tokens over the whole ``generate`` call (prefill included, the same for
both engines); each cell is the best of ``--repeats`` runs, the engines taking turns, since
other processes share the machine. The greedy outputs of the two engines are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

from pdinfer import LLM, SamplingParams

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. Every "
    "evening the keeper climbed the spiral stairs, one hundred and twelve of them, to light the lamp. "
    "Ships passing in the night saw the beam sweep across the water and knew the rocks were near.",
    "To make bread, mix four cups of flour with a spoonful of salt and a packet of yeast. Add warm water "
    "slowly until the dough comes together, then knead it for ten minutes on a floured table. Leave it "
    "to rise in a warm place for an hour, shape it into a loaf, and bake it until the crust is golden.",
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
    "the members agreed to increase spending on road repairs and to delay the new library until the "
    "following spring. The decision will be presented to the council at its next public meeting.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. Inside the "
    "leaves, chlorophyll absorbs sunlight and uses it to combine carbon dioxide and water into sugar, "
    "releasing oxygen as a by-product. Almost all life on Earth depends on this process.",
]
QUESTIONS = [
    "Write a short poem about the sea at night.",
    "What are three good habits for staying healthy? Explain each one.",
    "Describe your ideal weekend in a few sentences.",
    "Why do cats purr? Give a short answer.",
    "Tell me a story about a dragon who is afraid of the dark.",
    "What is the difference between weather and climate?",
    "List some tips for learning a new language.",
    "Explain how a bicycle works to a child.",
]


def prompts_for(llm: LLM, workload: str, batch: int) -> list[dict]:
    texts = []
    for i in range(batch):
        if workload == "repetitive":
            passage = PASSAGES[i % len(PASSAGES)]
            content = f"Rewrite the following text exactly as it is, word for word:\n\n{passage}"
        else:
            content = QUESTIONS[i % len(QUESTIONS)] + (f" (variant {i})" if i >= len(QUESTIONS) else "")
        texts.append([{"role": "user", "content": content}])
    prompts = []
    for conversation in texts:
        text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        prompts.append({"prompt_token_ids": llm.tokenizer(text, add_special_tokens=False).input_ids})
    return prompts


# A tiny DeepSeek-V3 (MLA, sigmoid-routed MoE) with one MTP layer, for ``--method mtp``.
TINY_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_experts_per_tok": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 64,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
}


def random_prompts(batch: int, vocab: int) -> list[dict]:
    rng = random.Random(0)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(30, 200))]} for _ in range(batch)
    ]


def run_once(llm: LLM, prompts: list[dict], params: SamplingParams):
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed, [o.outputs[0].token_ids for o in outputs]


def compare(base: LLM, spec: LLM, prompts: list[dict], params: SamplingParams, repeats: int):
    """Best tok/s of each engine over ``repeats`` turns, the engines taking turns (so a burst
    of load from other processes hits both alike); the acceptance rate; whether they agree."""
    pool = spec.engine.draft_pool
    drafted, accepted = pool.num_drafted_tokens, pool.num_accepted_tokens
    best_off = best_on = 0.0
    same = True
    for _ in range(repeats):
        off, expected = run_once(base, prompts, params)
        on, got = run_once(spec, prompts, params)
        best_off, best_on, same = max(best_off, off), max(best_on, on), same and got == expected
    rate = (pool.num_accepted_tokens - accepted) / max(1, pool.num_drafted_tokens - drafted)
    return best_off, best_on, rate, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--method", choices=["ngram", "mtp"], default="ngram")
    parser.add_argument("--k", type=int, default=3, help="draft tokens per step")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory", type=int, default=2 << 30)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads per engine (default: all cores)")
    args = parser.parse_args()
    common = dict(
        kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.batch_sizes), num_threads=args.num_threads
    )
    workloads = ("repetitive", "non-repetitive")
    if args.method == "mtp":
        folder = tempfile.mkdtemp(prefix="pdinfer-tiny-v3-")
        with open(f"{folder}/config.json", "w") as f:
            json.dump(TINY_V3, f)
        common.update(model=folder, load_format="dummy")
        workloads = ("random",)
    base = LLM(**common)
    spec = LLM(**common, speculative_method=args.method, num_draft_tokens=args.k)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.method == "mtp")
    print(f"{args.method} speculation, k={args.k}, greedy, up to {args.max_tokens} new tokens, best of {args.repeats}")
    header = (
        f"{'workload':<14}{'batch':>6}{'off tok/s':>11}{args.method + ' tok/s':>13}"
        f"{'speed-up':>10}{'accepted':>10}{'same':>6}"
    )
    print(header)
    print("-" * len(header))
    for workload in workloads:
        for batch in args.batch_sizes:
            if workload == "random":
                prompts = random_prompts(batch, TINY_V3["vocab_size"])
            else:
                prompts = prompts_for(base, workload, batch)
            run_once(base, prompts[:1], params)  # warm both engines
            run_once(spec, prompts[:1], params)
            off, on, rate, same = compare(base, spec, prompts, params, args.repeats)
            agree = "yes" if same else "NO"
            print(
                f"{workload:<14}{batch:>6}{off:>11.1f}{on:>13.1f}{on / off:>9.2f}x{rate:>10.0%}{agree:>6}", flush=True
            )


if __name__ == "__main__":
    main()

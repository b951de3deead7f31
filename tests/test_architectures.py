"""Every supported architecture equals transformers on a tiny random-weight checkpoint.

Each case builds a model with transformers (fixed seed, perturbed norm weights and biases so
they are really exercised), saves it as safetensors, loads the folder with pdinfer and compares
greedy tokens and the raw-model log-probabilities of every step with a plain greedy loop of the
transformers model.
"""

from __future__ import annotations

import pytest
import torch

from pdinfer import LLM, SamplingParams

VOCAB = 256
NEW_TOKENS = 16
PROMPT_LENS = (5, 23, 70, 97, 130)  # mixed; three are longer than the 64-token original context
MAX_REL_ERR = 1e-4
TOP_K = 20  # the most log-probs a request may ask for (sampling_params.MAX_LOGPROBS)

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN_ROPE = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}

CASES = {
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama-untied": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama-rope-llama3": ("LlamaConfig", dict(rope_scaling=LLAMA3_ROPE)),
    "llama-rope-linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2-qkv-bias": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3-qk-norm": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False)),
    "qwen2-rope-yarn": ("Qwen2Config", dict(rope_parameters=YARN_ROPE, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(head_dim=16)),  # its 4096-token window exceeds the context
}


def _build_checkpoint(config_name: str, overrides: dict, folder) -> torch.nn.Module:
    import transformers

    cfg = getattr(transformers, config_name)(**SMALL, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # transformers initialises these to 1: make them matter
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):  # and these to 0
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model.eval()


def _hf_greedy_logprobs(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation (argmax of raw logits) and the log-softmax of every step's logits."""
    ids, past, tokens, logprobs = torch.tensor([prompt]), None, [], []
    with torch.no_grad():
        for _ in range(steps):
            result = model(input_ids=ids, past_key_values=past, use_cache=True)
            past, logits = result.past_key_values, result.logits[0, -1].float()
            logprobs.append(torch.log_softmax(logits, dim=-1))
            tokens.append(int(logits.argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens, torch.stack(logprobs)


def _assert_top_logprobs(step_logprobs: dict[int, float], ref: torch.Tensor, where: str) -> None:
    """Our top-k log-probs are the reference's top k (up to ties) with the reference's values."""
    assert len(step_logprobs) >= TOP_K, where
    ids = torch.tensor(list(step_logprobs))
    ours = torch.tensor(list(step_logprobs.values()))
    kth = ref.topk(TOP_K).values[-1]
    assert bool((ref[ids] >= kth - 1e-4).all()), f"{where}: a token outside the reference top {TOP_K}"
    err = (ours - ref[ids]).norm() / ref[ids].norm()
    assert err < MAX_REL_ERR, f"{where}: rel err {err:.2e}"


def _assert_matches(llm, hf_model, prompts: list[list[int]], case: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ref_tokens, ref_logprobs = _hf_greedy_logprobs(hf_model, prompt, NEW_TOKENS)
        got = out.outputs[0]
        # Prefill (step 0) and every decode step, while the two runs share their context.
        agree = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref_tokens)) if a != b), NEW_TOKENS)
        for step in range(min(agree + 1, NEW_TOKENS)):
            where = f"{case}, prompt of {len(prompt)}: step {step}"
            _assert_top_logprobs(got.logprobs[step], ref_logprobs[step], where)
        top2 = ref_logprobs[min(agree, NEW_TOKENS - 1)].topk(2).values
        assert got.token_ids == ref_tokens, (
            f"{case}, prompt of {len(prompt)} tokens: first difference at step {agree} "
            f"(reference top-2 gap {float(top2[0] - top2[1]):.2e})"
        )
    assert llm.engine.get_num_free_blocks() == llm.engine.num_blocks


def _random_prompts(lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("case", list(CASES))
def test_architecture_matches_transformers(case, tmp_path):
    config_name, overrides = CASES[case]
    hf_model = _build_checkpoint(config_name, overrides, tmp_path)
    llm = LLM(model=str(tmp_path), num_kv_blocks=64)
    assert llm.engine.model_runner.spec.architecture == hf_model.config.architectures[0]
    _assert_matches(llm, hf_model, _random_prompts(PROMPT_LENS), case)
    # Two at a time: decode steps small enough for the native decoder stack (float weights:
    # up to 4 rows), which covers every architecture here.
    assert llm.engine.model_runner.model.decode_stack is not None
    _assert_matches(llm, hf_model, _random_prompts(PROMPT_LENS[:2]), case)


def test_sliding_window_caps_the_context(tmp_path):
    """Attention is full, which equals transformers' sliding window only inside the window:
    the context is capped there and a longer prompt is refused, never answered wrongly."""
    window = 48
    hf_model = _build_checkpoint("MistralConfig", dict(head_dim=16, sliding_window=window), tmp_path)
    llm = LLM(model=str(tmp_path), num_kv_blocks=64)
    assert llm.engine.scheduler_config.max_model_len == window
    _assert_matches(llm, hf_model, _random_prompts((5, 20, window - NEW_TOKENS)), "mistral-window")
    too_long = llm.generate(
        [{"prompt_token_ids": _random_prompts((70,))[0]}], SamplingParams(max_tokens=4), use_tqdm=False
    )[0]
    assert too_long.error and not too_long.outputs[0].token_ids

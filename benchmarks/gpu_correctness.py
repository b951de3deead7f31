"""The GPU suite's correctness section: transformers models built from the presets with a seed,
pdinfer engines on the same weights, and the comparisons (prefill logits whole and chunked, greedy
tokens, teacher-forced decode log-probs) in fp32 and bf16. ``correctness`` is run by
``gpu_suite.py`` and by ``two_gpu_workers.py``.
"""

from __future__ import annotations

import tempfile

import torch

from benchmarks.gpu_micro import FIG, free_memory, log, row
from pdinfer import LLM, SamplingParams
from pdinfer.models.loader import init_dummy_weights
from pdinfer.models.presets import PRESETS
from pdinfer.worker.cache_engine import CacheEngine
from pdinfer.worker.step_input import SampleSpec, StepInput

SEED = 1234


# --- models --------------------------------------------------------------------------------
def hf_model(preset: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(SEED)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**PRESETS[preset]), dtype=torch.bfloat16)
    # pdinfer's trained-like dummy weights (loader.py says why), by parameter name
    init_dummy_weights(model.named_parameters(), model.config.num_hidden_layers, SEED)
    return model.eval()


def pdinfer_like(hf, preset: str, via_folder: bool, **kwargs) -> LLM:
    if via_folder:
        folder = tempfile.mkdtemp(prefix="pdinfer-gpu-")
        hf.save_pretrained(folder)
        return LLM(model=folder, **kwargs)
    llm = LLM(model=f"preset:{preset}", load_format="dummy", **kwargs)
    llm.engine.model_runner.model.load_weights(hf.state_dict().items())
    return llm


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# --- 2. correctness ------------------------------------------------------------------------
def pdinfer_last_logits(llm: LLM, ids: list[int], chunks: int = 1) -> torch.Tensor:
    """Last-position logits through pdinfer's CUDA step path, on a scratch KV cache; with
    ``chunks`` > 1 the prompt is prefilled in pieces, each attending to the cached ones."""
    runner = llm.engine.model_runner
    bs = runner.cache.block_size
    num_blocks = -(-len(ids) // bs)
    scratch = CacheEngine(runner.spec, num_blocks, bs, runner.kv_dtype, runner.device)
    table = list(range(num_blocks))[::-1]  # scrambled: blocks in reverse order
    bounds = [len(ids) * i // chunks for i in range(chunks + 1)]
    with torch.inference_mode():
        for lo, hi in zip(bounds, bounds[1:]):
            inp = StepInput(
                step_id=-1,
                is_prompt=True,
                input_ids=ids[lo:hi],
                positions=list(range(lo, hi)),
                query_lens=[hi - lo],
                context_lens=[hi],
                block_tables=[table],
                samples=[SampleSpec(hi - lo - 1, 0.0, 0, 1.0, 0.0, 0, hi)],
            )
            step = runner.builder.build(inp)
            hidden = runner.model(step.input_ids, step.positions, scratch.kv, step.meta)
        return runner.model.compute_logits(hidden[-1:])[0].float()


def hf_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens of every prompt, all prompts in one left-padded batch (masked
    positions add exact zeros; one forward per token instead of one per token and prompt)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens = []
    with torch.inference_mode():
        out = hf(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        for i in range(n):
            tokens.append(out.logits[:, -1].float().argmax(-1))
            if i == n - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = hf(
                input_ids=tokens[-1][:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return torch.stack(tokens, dim=1).tolist()


LOGIT_LENGTHS = [17, 129, 300, 1000]
DECODE_TOP_K = 8  # log-probs per decode step compared with transformers
GREEDY_LENGTHS = [5, 17, 64, 100, 129, 200, 255, 300, 31, 47, 500, 777, 1000, 12, 1500, 90]


def correctness_prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    greedy = random_prompts(GREEDY_LENGTHS, vocab, seed=8)
    for i in (1, 5, 9):  # share a 128-token prefix with prompt 7 (prefix-cache hits)
        greedy[i] = greedy[7][:128] + greedy[i]
    return random_prompts(LOGIT_LENGTHS, vocab, seed=7), greedy


def hf_outputs(hf, logit_prompts, greedy_prompts) -> dict:
    logits = []
    with torch.inference_mode():
        for ids in logit_prompts:
            out = hf(input_ids=torch.tensor([ids], device="cuda"), logits_to_keep=1)
            logits.append([out.logits[0, -1].float()])
    return {"logits": logits, "greedy": hf_greedy(hf, greedy_prompts, 32)}


def pdinfer_outputs(llm: LLM, logit_prompts, greedy_prompts) -> dict:
    logits = [[pdinfer_last_logits(llm, ids, chunks) for chunks in (1, 2)] for ids in logit_prompts]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=DECODE_TOP_K)
    outs = llm.generate([{"prompt_token_ids": p} for p in greedy_prompts], params, use_tqdm=False)
    return {
        "logits": logits,
        "greedy": [o.outputs[0].token_ids for o in outs],
        "logprobs": [o.outputs[0].logprobs for o in outs],
    }


def decode_logprob_error(hf, greedy_prompts, ours: dict) -> float:
    """The decode path's numbers, which greedy agreement cannot see: our top-k log-probs at each
    of the 32 decode steps against transformers' at the same positions, teacher-forced on our
    own tokens (one forward over prompt + output). Max over prompts of ||ours - ref|| / ||ref||."""
    errs = []
    with torch.inference_mode():
        for prompt, tokens, steps in zip(greedy_prompts, ours["greedy"], ours["logprobs"]):
            ids = torch.tensor([prompt + tokens[:-1]], device=hf.device)
            ref = hf(input_ids=ids, logits_to_keep=len(tokens)).logits[0].float().log_softmax(-1)
            mine, theirs = [], []
            for row, step in zip(ref, steps):
                for token, logprob in step.items():
                    mine.append(logprob)
                    theirs.append(row[token].item())
            mine_t, ref_t = torch.tensor(mine), torch.tensor(theirs)
            errs.append(((mine_t - ref_t).norm() / ref_t.norm().clamp(min=1e-6)).item())
    return max(errs)


def compare(
    label: str,
    ours: dict,
    ref: dict,
    gate: bool,
    decode_err: float | None = None,
    floor: tuple[float, float] | None = None,
) -> None:
    """Logit relative error (max over prompts, whole and chunked prefill) and greedy agreement;
    with ``gate`` the brief's criteria (< 2e-2; >= 90% of prompts fully agree) decide PASS.

    ``floor``: (our bf16 error, transformers bf16's error), both against transformers fp32. Two
    bf16 implementations differ by their rounding, each about as far from the exact logits: where
    transformers bf16 is itself 2e-2 or more from fp32, no bf16 engine can be within 2e-2 of it.
    There the logits pass if ours are no farther from fp32 than transformers bf16's (PASS*)."""
    errs = [((o - r[0]).norm() / r[0].norm()).item() for os_, r in zip(ours["logits"], ref["logits"]) for o in os_]
    pairs = list(zip(ours["greedy"], ref["greedy"]))
    agree = sum(a == b for a, b in pairs)
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in pairs]
    FIG[label] = {
        "logit_rel_err": errs,
        "agree": agree,
        "of": len(pairs),
        "first_diff": first,
        "distinct_ref_tokens": [len(set(b)) for _, b in pairs],
        "decode_logprob_rel_err": decode_err,
    }
    logits_ok = max(errs) < 2e-2
    at_floor = not logits_ok and floor is not None and floor[1] >= 2e-2 and floor[0] <= floor[1]
    ok = (logits_ok or at_floor) and agree >= 0.9 * len(pairs) and (decode_err is None or decode_err < 2e-2)
    verdict = ("PASS" + ("*" if at_floor else "") if ok else "FAIL") if gate else "(reference)"
    if at_floor:
        verdict += f" (vs fp32: ours {floor[0]:.1e} <= transformers bf16 {floor[1]:.1e})"
    decode = "" if decode_err is None else f", decode top-{DECODE_TOP_K} logprobs {decode_err:.1e}"
    row(label, f"logits {max(errs):.1e}, greedy {agree}/{len(pairs)}{decode}", "< 2e-2, >= 90%", verdict)
    log(
        f"    first differing position per prompt: {first}; distinct tokens of each reference path: "
        f"{FIG[label]['distinct_ref_tokens']}"
    )


def upcast(hf16):
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        hf32 = AutoModelForCausalLM.from_config(hf16.config, dtype=torch.float32)
    hf32.load_state_dict(hf16.state_dict())  # the bf16 weights, exactly, in float32
    return hf32.eval()


def correctness(preset: str, name: str, via_folder: bool, engine_kwargs: dict, with_fp32: bool = True):
    """fp32 (the implementation, exactly) and bf16 (what runs) against transformers on the same
    weights. Returns the bf16 transformers model and pdinfer engine for the speed section."""
    hf16 = hf_model(preset)
    logit_prompts, greedy_prompts = correctness_prompts(hf16.config.vocab_size)
    hf32 = upcast(hf16)
    ref32 = hf_outputs(hf32, logit_prompts, greedy_prompts)
    ref16 = hf_outputs(hf16, logit_prompts, greedy_prompts)
    compare(f"{name} transformers bf16 vs transformers fp32", ref16, ref32, gate=False)
    if with_fp32:
        pd32 = pdinfer_like(
            hf32,
            preset,
            via_folder=False,
            dtype="float32",
            num_kv_blocks=1024,
            max_model_len=8192,
            max_num_batched_tokens=8192,
            max_num_seqs=16,
        )
        out32 = pdinfer_outputs(pd32, logit_prompts, greedy_prompts)
        pd32.engine.shutdown()
        del pd32
        compare(
            f"{name} pdinfer fp32 vs transformers fp32",
            out32,
            ref32,
            gate=True,
            decode_err=decode_logprob_error(hf32, greedy_prompts, out32),
        )
    del hf32
    free_memory()
    pd16 = pdinfer_like(hf16, preset, via_folder, **engine_kwargs)
    FIG[f"{name}_num_blocks"] = pd16.engine.num_blocks
    out16 = pdinfer_outputs(pd16, logit_prompts, greedy_prompts)
    compare(f"{name} pdinfer bf16 vs transformers fp32", out16, ref32, gate=False)
    floor = (
        max(FIG[f"{name} pdinfer bf16 vs transformers fp32"]["logit_rel_err"]),
        max(FIG[f"{name} transformers bf16 vs transformers fp32"]["logit_rel_err"]),
    )
    compare(
        f"{name} pdinfer bf16 vs transformers bf16",
        out16,
        ref16,
        gate=True,
        decode_err=decode_logprob_error(hf16, greedy_prompts, out16),
        floor=floor,
    )
    return hf16, pd16

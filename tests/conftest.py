"""Shared fixtures. The reference for model output is Hugging Face transformers, loading the
same GGUF file on its own (its own dequantization and Q/K un-permutation), in float32."""

from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import functools
import gc
import json
import os

import pytest
import torch

# Tests see the real default cache (so the GGUF conversion happens once per machine).
os.environ.setdefault("PDINFER_LOG_LEVEL", "WARNING")
# Without a GPU, Triton kernels run in Triton's interpreter (tests/test_triton_*.py). Set before
# any test imports pdinfer: a kernel is bound to the interpreter or to a GPU driver when its
# module is imported, and the MoE and MLA layers import their kernels with the models.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(os.cpu_count() or 1)


# --- a backstop for a hung test ----------------------------------------------------------------------
# pytest-timeout's default method raises SIGALRM in the main thread's Python code. A test blocked in
# C (a ZeroMQ send, a join) while the signal lands on one of the engine's threads never sees it, and
# the suite hangs. This watchdog is a C thread: past pytest-timeout's limit plus a margin it prints
# every thread's stack to the real stderr and ends the run with an error, so the suite always ends.
_BACKSTOP_MARGIN_S = 120.0
_stderr_fd = -1


def pytest_configure(config):
    global _stderr_fd
    _stderr_fd = os.dup(2)  # the terminal's stderr, not the capture file that os._exit would drop


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit_s = float(item.config.getoption("timeout", None) or 900)
    faulthandler.dump_traceback_later(limit_s + _BACKSTOP_MARGIN_S, exit=True, file=_stderr_fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _malloc_trim():
    libc = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None  # glibc only


_MALLOC_TRIM = _malloc_trim()


@pytest.fixture(scope="module", autouse=True)
def _return_freed_memory_to_the_os():
    """After each module, give back the heap its engines freed. glibc keeps freed memory in the
    process: running the whole suite, the pytest process grew to ~14 GB (~1-2 GB trimmed) and,
    with the servers that test_pd_processes starts, was OOM-killed on a 24 GB machine."""
    yield
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In a galaxy far, far away, there lived a small robot who loved to paint. " * 3,
    "Q: What is 2+2?\nA:",
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "import numpy as np\nimport torch\n\n# Load the dataset and",
    "A list of the planets of the solar system, from the closest to the Sun:",
    "Les pommes de terre sont",
]


@pytest.fixture(scope="session")
def default_model_path():
    from pdinfer.models.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer():
    from pdinfer import env
    from pdinfer.models.loader import load_tokenizer, resolve_model

    folder, _ = resolve_model(None, env.get("PDINFER_CACHE_DIR"))
    return load_tokenizer(folder, None)


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with the reference model: argmax of the raw logits, EOS not
    special (the ``ignore_eos`` behaviour), KV cache of transformers itself."""
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            result = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


@pytest.fixture(scope="session")
def reference(hf_model):
    """``reference(prompt_ids, n)``: cached transformers greedy continuation."""

    @functools.cache
    def run(prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
        return tuple(hf_greedy(hf_model, list(prompt_ids), max_new_tokens))

    return lambda ids, n: list(run(tuple(ids), n))


@pytest.fixture(scope="session")
def prompt_ids(tokenizer):
    return [tokenizer(p).input_ids for p in PROMPTS]


def make_llm(**kwargs):
    from pdinfer import LLM

    kwargs.setdefault("kv_cache_memory", 512 << 20)
    return LLM(**kwargs)


def assert_blocks_back(engine):
    assert not engine.has_unfinished_requests()
    assert engine.get_num_free_blocks() == engine.num_blocks, (
        f"{engine.num_blocks - engine.get_num_free_blocks()} KV blocks leaked"
    )


# --- the DP tests (test_dp*.py) --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random-weight Llama (``load_format="dummy"``) with the real tokenizer: (model
    folder, tokenizer). Used by the DP tests."""
    from dp_helpers import TINY_CONFIG

    from pdinfer import env
    from pdinfer.models.loader import resolve_model

    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    tokenizer, _ = resolve_model(None, env.get("PDINFER_CACHE_DIR"))
    return str(folder), tokenizer


# --- the OpenAI server tests (test_api_server*.py): one reference LLM per module -------------------
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference_llm():
    """The server tests' reference: an `LLM` in this process (checked against transformers in
    test_correctness), one per module: the AsyncEngine tests break theirs on purpose."""
    return make_llm(max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def greedy_texts(reference_llm):
    """LLM greedy text of PROMPTS at 8 and 12 tokens, and of CHAT at 16."""
    from pdinfer import SamplingParams

    texts = {}
    for n in (8, 12):
        outs = reference_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
        texts[n] = [o.outputs[0].text for o in outs]
    chat = reference_llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    texts["chat"] = chat[0].outputs[0].text
    return texts

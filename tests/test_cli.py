"""`pdinfer generate` as a real process: its streamed text equals `LLM` greedy text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_llm

from pdinfer import SamplingParams
from pdinfer.env import child_environ

PROMPT = "The capital of France is"
FLAGS = ["--max-tokens", "8", "--temperature", "0", "--kv-cache-memory", "512MiB"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _start(*args: str) -> subprocess.Popen:
    script = Path(sys.executable).with_name("pdinfer")  # the installed entry point
    command = [str(script)] if script.exists() else [sys.executable, "-m", "pdinfer.cli"]
    env = child_environ({"PDINFER_LOG_LEVEL": "WARNING"})
    return subprocess.Popen(
        command + ["generate", *args], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _check(proc: subprocess.Popen, expected: str) -> None:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    assert stdout == expected + "\n"


@pytest.fixture(scope="module")
def runs():
    """Both generate processes start first, so they load the model while this process does."""
    procs = {"plain": _start(PROMPT, *FLAGS), "chat": _start(PROMPT, "--chat", *FLAGS)}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def llm(runs):
    return make_llm()


def test_generate_prints_llm_greedy_text(runs, llm):
    expected = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].text
    _check(runs["plain"], expected)


def test_generate_chat_applies_the_chat_template(runs, llm):
    expected = llm.chat([{"role": "user", "content": PROMPT}], GREEDY, use_tqdm=False)
    text = expected[0].outputs[0].text
    assert text != llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].text
    _check(runs["chat"], text)


@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--max-tokens", "0"), ("--kv-cache-memory", "lots")])
def test_generate_refuses_bad_flags_before_loading(flag, value):
    proc = _start(PROMPT, flag, value)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert flag.strip("-").split("-")[0] in stderr


def test_python_dash_m_pdinfer_is_the_command():
    """``python -m pdinfer`` (a virtual environment not activated) runs the same CLI."""
    proc = subprocess.run(
        [sys.executable, "-m", "pdinfer", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "--api-key" in proc.stdout

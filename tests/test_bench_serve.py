"""`pdinfer bench serve` against a real `pdinfer serve`: every request completes and the rows
count them; a user's mistakes (a server that is down, zero prompts) get one line and exit 2,
not a traceback."""

from __future__ import annotations

import json
import subprocess

from servers import Server, free_port, pdinfer_command

ENGINE = ["--kv-cache-memory", "256MiB", "--max-model-len", "512"]


def bench(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*pdinfer_command(), "bench", "serve", *flags], capture_output=True, text=True, timeout=600)


def test_mistakes_get_one_line_and_exit_2():
    down = bench("--url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2")
    assert down.returncode == 2 and "Traceback" not in down.stderr, down.stderr
    assert "cannot list the models" in down.stderr
    for flag in ("--num-prompts", "--warmup"):
        bad = bench("--url", "http://127.0.0.1:1", flag, "-1")
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and flag in bad.stderr, bad.stderr


def test_bench_serve_completes_every_request_of_a_real_server(tmp_path):
    server = Server(["serve", *ENGINE], tmp_path / "serve.log")
    server.start()
    try:
        out = tmp_path / "rows.json"
        flags = ["--num-prompts", "4", "--concurrency", "2", "--input-len", "16", "--output-len", "4"]
        done = bench("--url", server.url, *flags, "--json", str(out))
        assert done.returncode == 0, done.stderr
        (row,) = json.loads(out.read_text())
        assert (row["completed"], row["failed"], row["load"]) == (4, 0, 2)
        # ignore_eos: each request yields its 4 tokens
        assert abs(row["output_tok_per_s"] * row["seconds"] - 16) < 1e-6
    finally:
        server.stop()

"""``pdinfer bench serve``: latency and throughput of any OpenAI-compatible server.

Streams completions with the ``openai`` client (AsyncOpenAI) at a fixed concurrency
(``--concurrency C``: C requests always in flight) or with Poisson arrivals (``--rate R``
requests/s: exponential gaps, whatever is still running). ``--loads`` runs several loads in a row
(rates or concurrencies, by the mode); several ``--url``s are measured one after the other on the
same prompts, which compares servers side by side. Prompts: a built-in synthetic set (random
common words, about one token each, ``--input-len`` long) or a JSONL file of
``{"prompt": ..., "max_tokens": ...}``. Prints TTFT, TPOT (time per output token after the first)
and end-to-end latency percentiles (p50/p90/p99) and throughput (req/s, output tok/s) per load;
``--plot`` writes latency against load as a PNG, ``--json`` the numbers.

``add_bench_parser`` registers ``pdinfer bench``; other benchmarks join it as sub-commands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdinfer.cli_args import non_negative_int, positive_int

_WORDS = (
    "the of and to in is it that was for on are with as his they be at one have this from or "
    "had by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every good "
    "me give our under name very through just form sentence great think say help low line differ "
    "turn cause much mean before move right boy old too same tell does set three want air well "
    "also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father head stand own page should country"
).split()
_PERCENTILES = (50, 90, 99)


@dataclass
class BenchRequest:
    prompt: str
    max_tokens: int


@dataclass
class Result:
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def parse_range(text: str) -> tuple[int, int]:
    """ "128" or "64-256" (uniform)."""
    try:
        low, _, high = text.partition("-")
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a length or a range: {text!r}") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise argparse.ArgumentTypeError(f"need 1 <= low <= high, got {text!r}")
    return bounds


def synthetic_dataset(
    num: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0
) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(*input_len))), rng.randint(*output_len))
        for _ in range(num)
    ]


def load_jsonl(path: str, num: int, default_max_tokens: int) -> list[BenchRequest]:
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            requests.append(BenchRequest(str(item["prompt"]), int(item.get("max_tokens", default_max_tokens))))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f'{path}:{number}: need {{"prompt": ..., "max_tokens": ...}} ({exc})') from None
        if len(requests) == num:
            break
    if not requests:
        raise ValueError(f"{path} has no requests")
    return requests


async def run_one(client, model: str, req: BenchRequest, args) -> Result:
    start = time.perf_counter()
    ttft, chunks, tokens = None, 0, None
    extra = {"ignore_eos": True} if args.ignore_eos else None
    try:
        stream = await client.completions.create(
            model=model,
            prompt=req.prompt,
            max_tokens=req.max_tokens,
            temperature=args.temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # any failure of the server counts, and the run goes on
        return Result(False, error=f"{type(exc).__name__}: {exc}"[:300])
    return Result(True, ttft, time.perf_counter() - start, tokens if tokens is not None else chunks)


async def run_load(
    client, model: str, requests: list[BenchRequest], mode: str, load: float, args
) -> tuple[list[Result], float]:
    """All requests at one load: (results, seconds from the first send to the last answer)."""
    rng = random.Random(args.seed)
    start = time.perf_counter()
    if mode == "concurrency":
        gate = asyncio.Semaphore(int(load))

        async def gated(req: BenchRequest) -> Result:
            async with gate:
                return await run_one(client, model, req, args)

        results = await asyncio.gather(*(gated(r) for r in requests))
    else:
        tasks = []
        for req in requests:
            tasks.append(asyncio.ensure_future(run_one(client, model, req, args)))
            await asyncio.sleep(rng.expovariate(load))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(label: str, mode: str, load: float, results: list[Result], seconds: float) -> dict:
    import numpy as np

    done = [r for r in results if r.ok]
    row = {
        "label": label,
        "mode": mode,
        "load": load,
        "completed": len(done),
        "failed": len(results) - len(done),
        "seconds": seconds,
        "req_per_s": len(done) / seconds if seconds else 0.0,
        "output_tok_per_s": sum(r.output_tokens for r in done) / seconds if seconds else 0.0,
    }
    for name, values in (
        ("ttft", [r.ttft_s for r in done if r.ttft_s is not None]),
        ("tpot", [r.tpot_s for r in done if r.tpot_s is not None]),
        ("e2e", [r.e2e_s for r in done if r.e2e_s is not None]),
    ):
        for p in _PERCENTILES:
            row[f"{name}_p{p}_ms"] = float(np.percentile(values, p)) * 1e3 if values else None
    errors = [r.error for r in results if r.error]
    row["first_error"] = errors[0] if errors else None
    return row


def format_table(rows: list[dict]) -> str:
    head = f"{'server':<14}{'load':>7}{'ok':>5}{'fail':>5}{'req/s':>8}{'tok/s':>8}" + "".join(
        f"{n + ' p' + str(p):>11}" for n in ("TTFT", "TPOT", "E2E") for p in _PERCENTILES
    )
    lines = [head + "   (latencies in ms)", "-" * len(head)]
    for r in rows:
        cells = "".join(
            f"{r[f'{n}_p{p}_ms']:>11.0f}" if r[f"{n}_p{p}_ms"] is not None else f"{'-':>11}"
            for n in ("ttft", "tpot", "e2e")
            for p in _PERCENTILES
        )
        lines.append(
            f"{r['label'][:13]:<14}{r['load']:>7g}{r['completed']:>5}{r['failed']:>5}"
            f"{r['req_per_s']:>8.2f}{r['output_tok_per_s']:>8.1f}{cells}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, mode: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6), dpi=80)
    panels = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("e2e", "end-to-end (ms)"))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    for ax, (name, title) in zip(axes, panels):
        for label in labels:
            mine = [r for r in rows if r["label"] == label]
            loads = [r["load"] for r in mine]
            for p, style in ((50, "-o"), (90, "--^")):
                ys = [r[f"{name}_p{p}_ms"] or float("nan") for r in mine]
                ax.plot(loads, ys, style, label=f"{label} p{p}", markersize=4)
        ax.set_title(title)
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        axes[3].plot([r["load"] for r in mine], [r["output_tok_per_s"] for r in mine], "-o", label=label, markersize=4)
    axes[3].set_title("output tokens/s")
    xlabel = "concurrency" if mode == "concurrency" else "request rate (req/s)"
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


async def bench(args) -> list[dict]:
    import openai

    if args.dataset == "synthetic":
        requests = synthetic_dataset(args.num_prompts, args.input_len, args.output_len, args.seed)
    else:
        requests = load_jsonl(args.dataset, args.num_prompts, args.output_len[1])
    mode = "rate" if args.rate is not None else "concurrency"
    loads = args.loads or [args.rate if mode == "rate" else (args.concurrency or 1)]
    labels = args.label or []
    rows = []
    for i, url in enumerate(args.url):
        label = labels[i] if i < len(labels) else url
        base = url.rstrip("/") + ("" if url.rstrip("/").endswith("/v1") else "/v1")
        client = openai.AsyncOpenAI(
            base_url=base, api_key=args.api_key or "none", max_retries=0, timeout=args.timeout_s
        )
        try:
            model = args.model or await _first_model(client, base)
            for _ in range(args.warmup):
                await run_one(client, model, BenchRequest(requests[0].prompt, 4), args)
            for load in loads:
                results, seconds = await run_load(client, model, requests, mode, load, args)
                rows.append(summarize(label, mode, load, results, seconds))
                print(format_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        finally:
            await client.close()
    return rows


async def _first_model(client, base: str) -> str:
    """The server's first model; a ValueError (one line for the user) when it cannot say."""
    import openai

    try:
        models = (await client.models.list()).data
    except openai.APIError as exc:
        raise ValueError(f"cannot list the models at {base} ({exc}); is the server up? (or give --model)") from None
    if not models:
        raise ValueError(f"{base} serves no model")
    return models[0].id


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (bench serve: an OpenAI-compatible server)")
    benchmarks = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    s = benchmarks.add_parser(
        "serve", help="latency and throughput of a running server", description=__doc__.split("\n\n")[1]
    )
    s.add_argument(
        "--url",
        action="append",
        required=True,
        help="the server (http://host:port or .../v1); repeat to compare servers",
    )
    s.add_argument("--label", action="append", help="a name per --url for the table and plot")
    s.add_argument("--model", default=None, help="default: the first of the server's /v1/models")
    s.add_argument("--api-key", default=None)
    mode = s.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    mode.add_argument("--concurrency", type=int, default=None, help="requests in flight (default mode, 1)")
    s.add_argument(
        "--loads",
        type=lambda t: [float(x) for x in t.split(",")],
        default=None,
        help="several rates or concurrencies (by the mode), e.g. 1,2,4",
    )
    s.add_argument("--num-prompts", type=positive_int, default=32)
    s.add_argument("--dataset", default="synthetic", help="'synthetic' or a JSONL file")
    s.add_argument(
        "--input-len",
        type=parse_range,
        default=(128, 128),
        help="synthetic prompt length in words (~tokens): N or LOW-HIGH",
    )
    s.add_argument(
        "--output-len",
        type=parse_range,
        default=(64, 64),
        help="max_tokens: N or LOW-HIGH (JSONL: where a line has none)",
    )
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos (pdinfer and vLLM extra) so outputs have max_tokens",
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--warmup", type=non_negative_int, default=1, help="unmeasured requests first, per server")
    s.add_argument("--timeout-s", type=float, default=1800.0)
    s.add_argument("--plot", default=None, help="write latency against load here (PNG)")
    s.add_argument("--json", default=None, help="write the rows here")
    s.set_defaults(func=run_bench_serve)


def run_bench_serve(args: argparse.Namespace) -> int:
    if args.concurrency is not None and args.concurrency < 1 or args.rate is not None and args.rate <= 0:
        print("pdinfer bench serve: --rate and --concurrency must be positive", file=sys.stderr)
        return 2
    try:
        rows = asyncio.run(bench(args))
    except (ValueError, OSError) as exc:
        print(f"pdinfer bench serve: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    for row in rows:
        if row["first_error"]:
            print(f"{row['label']} @ {row['load']:g}: {row['failed']} failed, e.g. {row['first_error']}")
    mode = rows[0]["mode"] if rows else "concurrency"
    if args.plot and rows:
        plot(rows, args.plot, mode)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["completed"] for r in rows) else 1

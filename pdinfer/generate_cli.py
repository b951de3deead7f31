"""``pdinfer generate``: one prompt through an in-process engine, streamed to the terminal."""

from __future__ import annotations

import argparse
import sys

from pdinfer.cli_args import add_engine_args, engine_args_from, positive_int


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text for one prompt, streamed to the terminal",
        description="Plain completion of the prompt by default; --chat wraps it in the model's "
        "chat template as one user message (what an instruct model expects).",
    )
    p.add_argument("prompt", help='the prompt; "-" reads it from stdin')
    p.add_argument("--max-tokens", type=positive_int, default=128, help="default 128")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0: sampled)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1: off")
    p.add_argument(
        "--seed",
        dest="sampling_seed",
        type=int,
        default=None,
        help="seed of the sampling stream (same seed, same text)",
    )
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    add_engine_args(p, include_seed=False)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from pdinfer.engine.llm_engine import LLMEngine
    from pdinfer.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as exc:
        print(f"pdinfer generate: {exc}", file=sys.stderr)
        return 2
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = LLMEngine(engine_args_from(args))
    try:
        prompt = _chat_prompt(engine, text) if args.chat else text
        engine.add_request("generate-0", prompt, params)
        return _stream_to_stdout(engine, "generate-0")
    except ValueError as exc:
        print(f"pdinfer generate: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()


def _chat_prompt(engine, text: str) -> dict:
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        raise ValueError("--chat: this model has no chat template")
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    ids = engine.tokenizer(rendered, add_special_tokens=False).input_ids
    return {"prompt": rendered, "prompt_token_ids": ids}


def _stream_to_stdout(engine, request_id: str) -> int:
    printed, status = 0, 0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text if output.outputs else ""
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = max(printed, len(text))
                if output.finished and output.error:
                    print(f"\npdinfer generate: {output.error}", file=sys.stderr)
                    status = 1
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        status = 130
    sys.stdout.write("\n")
    sys.stdout.flush()
    return status

"""``specdecode generate``: text for one prompt, streamed, with its metrics."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specdecode.cli.args import add_decoder_arguments


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt",
        description=(
            "Generate text for PROMPT. Models are demo names (qwen2.5-coder-1.5b-instruct, "
            "qwen2.5-coder-0.5b-instruct), .gguf files, local Hugging Face folders or hub ids. "
            "Without --target/--draft the embedded demo pair is used."
        ),
    )
    gen.add_argument("prompt", help="the prompt text ('-' reads it from standard input)")
    add_decoder_arguments(gen)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    gen.add_argument("--quiet", action="store_true", help="no progress bars or metrics on stderr")
    gen.add_argument("--show-drafts", action="store_true",
                     help="colour the text of accepted draft tokens (on a terminal; plain text when the output is "
                          "not one, or NO_COLOR is set)")

# ANSI colour of accepted draft tokens under --show-drafts, and the reset after them.
DRAFT_COLOUR, RESET = "\x1b[32m", "\x1b[0m"


def cmd_generate(args: argparse.Namespace) -> int:
    from specdecode import DecoderConfig, SamplingParams, SpecDecoder

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    decoder = SpecDecoder.from_config(DecoderConfig.from_args(args), show_progress=not args.quiet)
    if args.compile:
        log = decoder.warm_up(show_progress=not args.quiet)
        if not args.quiet:
            print(f"specdecode: {log.summary()}", file=sys.stderr, flush=True)
    stream = decoder.stream(prompt, params, chat=args.chat)
    if args.json:
        for _ in stream:
            pass
        assert stream.result is not None
        json.dump(stream.result.to_dict(), sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
        return 0
    colour = args.show_drafts and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    for delta, from_draft in stream.spans():
        sys.stdout.write(f"{DRAFT_COLOUR}{delta}{RESET}" if colour and from_draft else delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if not args.quiet:
        assert stream.result is not None
        print(stream.result.stats.summary(), file=sys.stderr)
        if colour:
            print(f"{DRAFT_COLOUR}green{RESET}: text of accepted draft tokens; the rest is the target's own tokens.",
                  file=sys.stderr)
    return 0

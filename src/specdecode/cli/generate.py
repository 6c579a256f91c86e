"""``specdecode generate``: text for one prompt, streamed, with its metrics."""

from __future__ import annotations

import argparse
import json
import sys

from specdecode.backends.base import BACKENDS
from specdecode.backends.device import DEVICE_CHOICES, DTYPE_CHOICES
from specdecode.cli.args import (
    add_compile_arguments,
    add_k_policy_arguments,
    add_layerskip_arguments,
    add_ngram_arguments,
    add_quant_arguments,
    compile_choice,
    k_value,
)
from specdecode.cli.train import add_tree_arguments
from specdecode.config import DEFAULT_DRAFT_CONFIDENCE, DEFAULT_K, METHODS


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
    gen.add_argument("--target", help="the model whose output is reproduced (default: demo 1.5B)")
    gen.add_argument("--draft", help="the small draft model (default: demo 0.5B with the demo target)")
    gen.add_argument(
        "--method", choices=METHODS, default="draft",
        help=(
            "draft: a draft model proposes; ngram: prompt lookup proposes (no draft model); auto: each "
            "step, lookup, draft model or plain decoding, whichever pays by measured cost and acceptance "
            "(up to --k-max tokens); layerskip: the target drafts with layers skipped; medusa, eagle: "
            "trained heads (--heads) draft a token tree; suffix: token trees from the text so far, ranked by "
            "how often each continuation followed (no model); none: plain decoding"
        ),
    )
    gen.add_argument(
        "--k", type=k_value, default=None,
        help=f"tokens drafted per step, or 'auto': chosen each step from live acceptance and measured costs "
        f"(default {DEFAULT_K}; auto on the llama.cpp backend)",
    )
    add_k_policy_arguments(gen)
    gen.add_argument(
        "--draft-confidence",
        type=float,
        default=DEFAULT_DRAFT_CONFIDENCE,
        help="stop drafting once the draft's probability for its token is below this (0 = always draft k)",
    )
    add_ngram_arguments(gen)
    add_layerskip_arguments(gen)
    add_tree_arguments(gen, bench=False)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--dtype", choices=list(DTYPE_CHOICES), default="auto", help="auto: bf16 where supported, else fp32")
    gen.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    gen.add_argument("--backend", choices=BACKENDS, default="auto",
                     help="auto: llama.cpp for GGUF files on the CPU where llama-cpp-python is installed, else torch")
    add_quant_arguments(gen)
    add_compile_arguments(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    gen.add_argument("--quiet", action="store_true", help="no progress bars or metrics on stderr")


def cmd_generate(args: argparse.Namespace) -> int:
    from specdecode import SamplingParams, SpecDecoder

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    decoder = SpecDecoder.from_pretrained(
        args.target,
        args.draft,
        method=args.method,
        k=args.k,
        k_policy=args.k_policy if args.k == "auto" else None,
        k_max=args.k_max,
        draft_confidence=args.draft_confidence,
        ngram_max=args.ngram_max,
        ngram_min=args.ngram_min,
        skip_layers=args.skip_layers,
        layerskip_config=args.layerskip_config,
        dtype=args.dtype,
        device=args.device,
        target_quant=args.target_quant,
        draft_quant=args.draft_quant,
        kv_dtype=args.kv_dtype,
        backend=args.backend,
        heads=args.heads,
        tree_size=args.tree_size,
        acceptance=args.acceptance,
        show_progress=not args.quiet,
        compile=compile_choice(args),
    )
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
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if not args.quiet:
        assert stream.result is not None
        print(stream.result.stats.summary(), file=sys.stderr)
    return 0

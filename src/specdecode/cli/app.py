"""The ``specdecode`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from specdecode.backends.base import BACKENDS
from specdecode.backends.device import DEVICE_CHOICES, DTYPE_CHOICES
from specdecode.cli.audit import add_audit_parser, cmd_audit
from specdecode.cli.serve import add_serve_parser, cmd_serve
from specdecode.cli.train import add_train_parser, add_tree_arguments, cmd_train
from specdecode.cli.train import positive_int as _positive_int
from specdecode.config import (
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_K,
    DEFAULT_K_MAX,
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
    METHODS,
)
from specdecode.errors import InvalidRequestError, SpecDecodeError
from specdecode.kv.static import KV_DTYPES

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdecode",
        description="Lossless speculative decoding for Llama-family models.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
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
            "trained heads (--heads) draft a token tree; none: plain decoding"
        ),
    )
    gen.add_argument(
        "--k", type=_k_value, default=None,
        help=f"tokens drafted per step, or 'auto': chosen each step from live acceptance and measured costs "
        f"(default {DEFAULT_K}; auto on the llama.cpp backend)",
    )
    _add_k_policy_arguments(gen)
    gen.add_argument(
        "--draft-confidence",
        type=float,
        default=DEFAULT_DRAFT_CONFIDENCE,
        help="stop drafting once the draft's probability for its token is below this (0 = always draft k)",
    )
    _add_ngram_arguments(gen)
    _add_layerskip_arguments(gen)
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
    _add_quant_arguments(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    gen.add_argument("--quiet", action="store_true", help="no progress bars or metrics on stderr")
    _add_bench_parser(sub)
    _add_quality_parser(sub)
    _add_tune_layerskip_parser(sub)
    _add_distill_parser(sub)
    add_train_parser(sub)
    add_serve_parser(sub)
    add_audit_parser(sub)
    return parser


def _add_distill_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.training import distill as d

    parser = sub.add_parser(
        "distill",
        help="fine-tune the draft model on the target's own answers (acceptance before/after)",
        description=(
            "The target answers the training prompts; the draft's top layers are fine-tuned on those "
            "answers (cross-entropy, the rest frozen); the result is a model folder for --draft. "
            "Acceptance of the base and the distilled draft is then measured on held-apart prompts."
        ),
    )
    parser.add_argument("--target", help="target model (default: demo 1.5B)")
    parser.add_argument("--draft", help="draft model to distil (default: demo 0.5B with the demo target)")
    parser.add_argument("--prompts", help="training prompts, one per line (default: --train-per-category rows of each bench category, from row 10 on)")
    parser.add_argument("--train-per-category", type=_positive_int, default=5, help="default training prompts per category")
    parser.add_argument("--eval-prompts", help="held-apart prompts, one per line (default: 2 per category, from row 20 on)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=d.DEFAULT_MAX_NEW_TOKENS, help="tokens per target answer and per evaluation")
    parser.add_argument("--train-layers", type=_positive_int, default=d.DEFAULT_TRAIN_LAYERS, help="top decoder layers trained (the rest is frozen)")
    parser.add_argument("--epochs", type=_positive_int, default=d.DEFAULT_EPOCHS)
    parser.add_argument("--lr", type=float, default=d.DEFAULT_LR)
    parser.add_argument("--accumulate", type=_positive_int, default=d.DEFAULT_ACCUMULATE, help="sequences per optimizer step")
    parser.add_argument("--warmup-steps", type=int, default=0, help="optimizer steps of linear learning-rate warm-up (default 0)")
    parser.add_argument("--loss", choices=d.LOSSES, default="kl", help="kl: match the target's distribution (default); ce: its tokens")
    parser.add_argument("--teacher-top-k", type=_positive_int, default=d.DEFAULT_TEACHER_TOP_K, help="kl: target probabilities kept per position")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat", choices=("auto", "yes", "no"), default="auto", help="use the chat template (auto: when the tokenizer has one)")
    parser.add_argument("--no-eval", action="store_true", help="skip the before/after acceptance measurement")
    parser.add_argument("--dtype", choices=list(DTYPE_CHOICES), default="auto", help="for generating and evaluating (training is fp32)")
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    parser.add_argument("--out", default="distilled-draft", help="output folder; rerunning resumes from it (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true")


def _read_prompt_lines(path: str, flag: str) -> list[str]:
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError as err:
        raise InvalidRequestError(f"Cannot read {flag} {path}: {err}") from err
    if not lines:
        raise InvalidRequestError(f"{flag} {path} has no prompts.")
    return lines


def _use_chat(tokenizer: object, choice: str) -> bool:
    """--chat auto|yes|no: auto uses the chat template when the tokenizer has one."""
    return bool(getattr(tokenizer, "chat_template", None)) if choice == "auto" else choice == "yes"


def cmd_distill(args: argparse.Namespace) -> int:
    from specdecode import SpecDecoder
    from specdecode.models.loader import load_model
    from specdecode.training import distill as d

    config = d.DistillConfig(
        out=Path(args.out), max_new_tokens=args.max_new_tokens, train_layers=args.train_layers, epochs=args.epochs,
        lr=args.lr, accumulate=args.accumulate, warmup_steps=args.warmup_steps, seed=args.seed, loss=args.loss, teacher_top_k=args.teacher_top_k,
        show_progress=not args.quiet,
    )
    train = _read_prompt_lines(args.prompts, "--prompts") if args.prompts else d.held_apart_prompts(10, args.train_per_category)
    held = _read_prompt_lines(args.eval_prompts, "--eval-prompts") if args.eval_prompts else d.held_apart_prompts(20, 2)
    overlap = set(train) & set(held)
    if overlap:
        raise InvalidRequestError(f"{len(overlap)} evaluation prompt(s) also appear among the training prompts; keep them apart.")
    base = SpecDecoder.from_pretrained(args.target, args.draft, method="draft", draft_confidence=0.0, backend="torch",
                                       dtype=args.dtype, device=args.device, show_progress=not args.quiet)
    assert base.draft is not None
    if config.train_layers > base.draft.config.num_layers:
        raise InvalidRequestError(f"--train-layers {config.train_layers} exceeds the draft's {base.draft.config.num_layers} layers.")
    chat = _use_chat(base.tokenizer, args.chat)
    log = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr))
    config.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data = d.make_data(base, train, config.out / d.DATA_FILE, config.max_new_tokens, chat, not args.quiet)
    data_seconds = time.perf_counter() - started
    training = d.train_draft(base.draft.folder, data, config, log=log, target=base.target.model)
    report = {"base_draft": base.draft.name, "target": base.target.name, "out": str(config.out),
              "training_prompts": len(train), "answer_tokens": sum(len(a) for _, a in data),
              "data_seconds": round(data_seconds, 1), **training}
    if not args.no_eval:
        distilled = load_model(str(config.out), base.draft.model.dtype, base.draft.model.device, show_progress=not args.quiet)
        tuned = SpecDecoder(base.target, distilled, base.spec)
        reports = d.compare_drafts({"before": base, "after": tuned}, held, chat, config.max_new_tokens, show_progress=not args.quiet)
        report["held_apart"] = {name: r.to_dict() for name, r in reports.items()}
    d.write_report(config.out, report)
    if args.no_eval:
        print(f"distilled draft saved to {config.out}")
    else:
        before, after = report["held_apart"]["before"]["acceptance"], report["held_apart"]["after"]["acceptance"]
        change = f" ({after / before - 1:+.1%} relative)" if before and after is not None else ""
        print(f"acceptance on {len(held)} held-apart prompts: {before} -> {after}{change}; draft saved to {config.out}")
    return 0


def _add_tune_layerskip_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.training.layer_search import (
        DEFAULT_CALIBRATION_PER_CATEGORY,
        DEFAULT_CALIBRATION_TOKENS,
        DEFAULT_MEASURE_TOP,
    )

    tune = sub.add_parser(
        "tune-layerskip",
        help="choose which target layers --method layerskip skips, by measured tokens/s",
        description=(
            "Rank the target's layers by how little they change the residual stream on calibration "
            "prompts, predict the speedup of skipping the m least influential ones from teacher-forced "
            "agreement and measured pass costs, then measure the best predictions against plain "
            "decoding and save the fastest as JSON for --layerskip-config."
        ),
    )
    tune.add_argument("--target", help="target model (default: demo 1.5B)")
    tune.add_argument(
        "--prompts", help="a text file, one calibration prompt per line (default: the last prompts of each bench category)"
    )
    tune.add_argument("--per-category", type=_positive_int, default=DEFAULT_CALIBRATION_PER_CATEGORY,
                      help="default prompts: how many from the end of each category")
    tune.add_argument("--max-new-tokens", type=_positive_int, default=DEFAULT_CALIBRATION_TOKENS, help="per calibration prompt")
    tune.add_argument("--skip-counts", type=_csv, default=None, help="numbers of layers to try skipping, e.g. 4,6,8 (default: 2..half)")
    tune.add_argument("--measure-top", type=_positive_int, default=DEFAULT_MEASURE_TOP, help="predictions measured for real")
    tune.add_argument("--k-max", type=_positive_int, default=DEFAULT_K_MAX, help="most tokens drafted per step")
    tune.add_argument("--chat", choices=("auto", "yes", "no"), default="auto", help="use the chat template (auto: when the tokenizer has one)")
    tune.add_argument("--dtype", choices=list(DTYPE_CHOICES), default="auto")
    tune.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    tune.add_argument("--out", default="layerskip.json", help="where to write the choice (default: %(default)s)")
    tune.add_argument("--quiet", action="store_true")


def cmd_tune_layerskip(args: argparse.Namespace) -> int:
    from specdecode import SpecDecoder
    from specdecode.training.layer_search import calibration_prompts, tune_layerskip

    texts = _read_prompt_lines(args.prompts, "--prompts") if args.prompts else calibration_prompts(args.per_category)
    try:
        skip_counts = [int(c) for c in args.skip_counts] if args.skip_counts else None
    except ValueError:
        raise InvalidRequestError(f"--skip-counts takes integers, got {','.join(args.skip_counts)}.") from None
    decoder = SpecDecoder.from_pretrained(
        args.target, method="none", k_max=args.k_max, dtype=args.dtype, device=args.device, backend="torch",
        show_progress=not args.quiet,
    )
    chat = _use_chat(decoder.tokenizer, args.chat)
    prompts = [decoder.encode(text, chat=chat) for text in texts]
    log = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr))
    choice = tune_layerskip(
        decoder.engine, decoder.target.name, prompts, max_new_tokens=args.max_new_tokens,
        skip_counts=skip_counts, measure_top=args.measure_top, k_max=args.k_max, log=log,
    )
    out = Path(args.out)
    choice.save(out)
    measured = choice.measured
    print(
        f"skip layers {','.join(map(str, choice.skip_layers))} of {choice.num_layers}: "
        f"{measured['measured_speedup']:.2f}x plain decoding on the calibration prompts "
        f"(tau {measured['measured_tau'] or 0:.2f}); saved to {out}"
    )
    return 0


def _add_quality_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.bench.quality import DEFAULT_MAX_TOKENS, DEFAULT_WINDOW

    quality = sub.add_parser(
        "quality",
        help="what weight quantization costs: KL to the unquantized target, perplexity, top-1 agreement",
        description=(
            "Score a fixed text with the target unquantized and with each --quants variant, and "
            "report the mean KL divergence to the unquantized next-token distributions, perplexity, "
            "and how often the most likely next token agrees. Default text: Python stdlib source."
        ),
    )
    quality.add_argument("--target", help="target model (default: demo 1.5B)")
    quality.add_argument("--quants", type=_csv, default=("int8", "int4"), help="comma-separated: int8, int4 (default: int8,int4)")
    quality.add_argument("--text", help="a text file to score (default: Python standard-library source)")
    quality.add_argument("--window", type=_positive_int, default=DEFAULT_WINDOW, help="tokens per forward pass")
    quality.add_argument("--max-tokens", type=_positive_int, default=DEFAULT_MAX_TOKENS, help="tokens of the text scored")
    quality.add_argument("--dtype", choices=list(DTYPE_CHOICES), default="auto")
    quality.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    quality.add_argument("--out", help="also write the rows as JSON here")
    quality.add_argument("--quiet", action="store_true")


def cmd_quality(args: argparse.Namespace) -> int:
    from specdecode.bench.quality import default_text, markdown_table, measure_quality, write_quality

    if args.text:
        try:
            text, description = Path(args.text).read_text(), args.text
        except OSError as err:
            raise InvalidRequestError(f"Cannot read --text {args.text}: {err}") from err
    else:
        text, description = default_text()
    rows = measure_quality(
        args.target, args.quants, text, dtype=args.dtype, device=args.device, window=args.window,
        max_tokens=args.max_tokens, show_progress=not args.quiet,
    )
    print(f"Text: {description}\n")
    print(markdown_table(rows))
    if args.out:
        write_quality(rows, description, Path(args.out))
    return 0


def _add_quant_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.quant.apply import QUANT_CHOICES

    parser.add_argument(
        "--target-quant", choices=QUANT_CHOICES, default="none",
        help="weight-only quantization of the target (int4 keeps a Q4_K GGUF's own blocks); changes the target's output",
    )
    parser.add_argument("--draft-quant", choices=QUANT_CHOICES, default="none", help="weight-only quantization of the draft")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto", help="KV-cache storage: auto (model dtype) or int8")


def _k_value(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def _add_k_policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--k-policy", choices=("cost", "threshold"), default="cost",
        help="with --k auto: cost (maximise expected tokens per measured second; may choose plain steps) "
        "or threshold (k+1 above 80%% acceptance, minimum below 40%%, starting at 5)",
    )
    parser.add_argument("--k-max", type=_positive_int, default=DEFAULT_K_MAX, help="with --k auto: the most tokens drafted per step")


def _add_ngram_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ngram-max", type=_positive_int, default=DEFAULT_NGRAM_MAX, help="ngram: longest n-gram matched")
    parser.add_argument("--ngram-min", type=_positive_int, default=DEFAULT_NGRAM_MIN, help="ngram: shortest n-gram matched")


def _skip_layers(text: str) -> tuple[int, ...]:
    from specdecode.training.layer_search import parse_skip_layers

    try:
        return parse_skip_layers(text)
    except InvalidRequestError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_layerskip_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--skip-layers", type=_skip_layers, default=None,
        help="layerskip: target layers the draft skips, e.g. '4-9,12' (default: --layerskip-config, or the demo target's tuned choice)",
    )
    parser.add_argument("--layerskip-config", help="layerskip: a JSON file written by `specdecode tune-layerskip`")


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.bench.llamacpp_bin import DEFAULT_BIN_TIMEOUT_SECONDS
    from specdecode.bench.methods import DEFAULT_HF_LOOKUP_TOKENS, DEFAULT_LLAMACPP_LOOKUP_TOKENS, available_methods
    from specdecode.bench.prompts import CATEGORIES
    from specdecode.bench.runner import DEFAULT_METHODS

    bench = sub.add_parser(
        "bench",
        help="benchmark methods against plain decoding and Hugging Face, in one run",
        description=(
            "Run every method on the same prompts, interleaved per prompt, and report tokens/s, "
            "speedups, tau, acceptance (overall and per draft position), the time split, peak RSS, "
            "greedy output equality and the memory-bandwidth ceiling. Writes results.json, "
            "report.md, speedup.png and acceptance.png into --out."
        ),
    )
    bench.add_argument("--target", help="target model (default: demo 1.5B)")
    bench.add_argument("--draft", help="draft model for draft / hf-assisted (default: demo 0.5B with the demo target)")
    bench.add_argument(
        "--methods", type=_csv, default=DEFAULT_METHODS,
        help=f"comma-separated, from: {', '.join(available_methods())}; a specdecode method may add weight "
        "quantizations: none@int8 (int8 target), draft@int8/int4 (int8 target, int4 draft), or run on the "
        "llama.cpp backend: none@llama.cpp, draft:3@llama.cpp (GGUF --target/--draft) "
        "(default: %(default)s)".replace("%(default)s", ",".join(DEFAULT_METHODS)),
    )
    bench.add_argument(
        "--prompts", type=_csv, default=("default",),
        help="comma-separated sources: default (Spec-Bench dev subset + HumanEval), spec_bench, humaneval, "
        "a Spec-Bench .jsonl file, or a text file with one prompt per line",
    )
    bench.add_argument(
        "--categories", type=_csv, default=("all",),
        help=f"comma-separated categories or 'all' (default set: {', '.join(CATEGORIES)})",
    )
    bench.add_argument("--max-prompts-per-category", type=_positive_int, default=3, help="first N of each category's fixed order")
    bench.add_argument("--max-new-tokens", type=_positive_int, default=128, help="per turn")
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); equality is checked only then")
    bench.add_argument("--top-k", type=int, default=0)
    bench.add_argument("--top-p", type=float, default=1.0)
    bench.add_argument("--seed", type=int, default=0, help="sampling seed (each generation restarts from it)")
    bench.add_argument("--k", type=_positive_int, default=None, help=f"draft tokens per step (default {DEFAULT_K})")
    bench.add_argument("--draft-confidence", type=float, default=None, help=f"draft confidence cut-off (default {DEFAULT_DRAFT_CONFIDENCE})")
    _add_ngram_arguments(bench)
    _add_layerskip_arguments(bench)
    add_tree_arguments(bench, bench=True)
    bench.add_argument("--hf-lookup-tokens", type=_positive_int, default=DEFAULT_HF_LOOKUP_TOKENS, help="prompt_lookup_num_tokens for hf-lookup")
    bench.add_argument(
        "--llamacpp-lookup-tokens", type=_positive_int, default=DEFAULT_LLAMACPP_LOOKUP_TOKENS,
        help="num_pred_tokens for llamacpp-lookup (default %(default)s: llama-cpp-python's advice for CPUs)",
    )
    bench.add_argument(
        "--llamacpp-bin", metavar="DIR",
        help="folder holding llama.cpp's llama-speculative-simple and llama-lookup, for llamacpp-bin-draft and "
        "llamacpp-bin-lookup (build them with /work/shared/tools/build-llamacpp-tools.sh)",
    )
    bench.add_argument(
        "--llamacpp-bin-timeout", type=float, default=DEFAULT_BIN_TIMEOUT_SECONDS,
        help="seconds one run of a llama.cpp binary may take (default %(default)s)",
    )
    bench.add_argument("--repeats", type=_positive_int, default=1, help="runs per prompt and method; the median-time run counts")
    bench.add_argument("--no-warmup", action="store_true", help="skip the warm-up prompt")
    bench.add_argument("--chat", choices=("auto", "yes", "no"), default="auto", help="use the chat template (auto: when the tokenizer has one)")
    bench.add_argument("--dtype", choices=list(DTYPE_CHOICES), default="auto")
    bench.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    bench.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto", help="KV-cache storage of specdecode's methods")
    bench.add_argument("--bandwidth-probe-mib", type=int, default=1024, help="size of the copy-bandwidth probe (0 = skip it and the ceilings)")
    bench.add_argument(
        "--from-results", metavar="RESULTS_JSON",
        help="measure nothing: recompute the summary, report and plots of a stored results.json with this "
        "version's report code, into --out",
    )
    bench.add_argument("--out", default="results", help="output folder (default: %(default)s)")
    bench.add_argument("--no-plots", action="store_true")
    bench.add_argument("--quiet", action="store_true", help="no progress or tables")


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdecode.bench import BenchConfig, resummarize, run_bench

    config = BenchConfig(
        target=args.target,
        draft=args.draft,
        methods=args.methods,
        prompts=args.prompts,
        categories=args.categories,
        max_prompts_per_category=args.max_prompts_per_category,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        k=args.k,
        draft_confidence=args.draft_confidence,
        ngram_max=args.ngram_max,
        ngram_min=args.ngram_min,
        skip_layers=args.skip_layers,
        layerskip_config=args.layerskip_config,
        medusa_heads=args.medusa_heads,
        eagle_heads=args.eagle_heads,
        tree_size=args.tree_size,
        hf_lookup_tokens=args.hf_lookup_tokens,
        llamacpp_lookup_tokens=args.llamacpp_lookup_tokens,
        llamacpp_bin=args.llamacpp_bin,
        llamacpp_bin_timeout=args.llamacpp_bin_timeout,
        repeats=args.repeats,
        warmup=not args.no_warmup,
        chat={"auto": None, "yes": True, "no": False}[args.chat],
        dtype=args.dtype,
        device=args.device,
        kv_dtype=args.kv_dtype,
        bandwidth_probe_bytes=max(0, args.bandwidth_probe_mib) << 20,
        out=Path(args.out),
        plots=not args.no_plots,
        quiet=args.quiet,
    )
    if args.from_results:
        resummarize(Path(args.from_results), config)
        return 0
    results = run_bench(config)
    return 0 if results["complete"] else EXIT_INTERRUPTED


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
    )
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "quality":
            return cmd_quality(args)
        if args.command == "tune-layerskip":
            return cmd_tune_layerskip(args)
        if args.command == "distill":
            return cmd_distill(args)
        if args.command == "train":
            return cmd_train(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "audit":
            return cmd_audit(args)
    except SpecDecodeError as err:
        print(f"specdecode: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of our output went away (`specdecode generate ... | head`): not an error.
        sys.stderr.close()
        return 0
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())

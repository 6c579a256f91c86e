"""``specdecode tune-layerskip`` (the layer search) and ``specdecode distill`` (a draft trained on the target's answers)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specdecode.cli.args import add_decoder_arguments, comma_list, read_prompt_lines, use_chat
from specdecode.cli.train import positive_int as _positive_int
from specdecode.core.device import DEVICE_CHOICES, DTYPE_CHOICES
from specdecode.errors import InvalidRequestError

# Decoder options tune-layerskip does not take: it runs the target alone, on torch, eagerly.
TUNE_EXCLUDED = frozenset({
    "draft", "method", "k", "k_policy", "draft_confidence", "ngram_max", "ngram_min", "skip_layers", "layerskip_config",
    "heads", "tree_size", "acceptance", "suffix_cache_tokens", "backend", "draft_quant", "compile", "engine",
})


def add_tune_layerskip_parser(sub: argparse._SubParsersAction) -> None:
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
    tune.add_argument(
        "--prompts", help="a text file, one calibration prompt per line (default: the last prompts of each bench category)"
    )
    tune.add_argument("--per-category", type=_positive_int, default=DEFAULT_CALIBRATION_PER_CATEGORY,
                      help="default prompts: how many from the end of each category")
    tune.add_argument("--max-new-tokens", type=_positive_int, default=DEFAULT_CALIBRATION_TOKENS, help="per calibration prompt")
    tune.add_argument("--skip-counts", type=comma_list, default=None, help="numbers of layers to try skipping, e.g. 4,6,8 (default: 2..half)")
    tune.add_argument("--measure-top", type=_positive_int, default=DEFAULT_MEASURE_TOP, help="predictions measured for real")
    tune.add_argument("--chat", choices=("auto", "yes", "no"), default="auto", help="use the chat template (auto: when the tokenizer has one)")
    # The search runs the target alone on torch, with layers skipped: the other options do not apply.
    add_decoder_arguments(tune, exclude=TUNE_EXCLUDED)
    tune.add_argument("--out", default="layerskip.json", help="where to write the choice (default: %(default)s)")
    tune.add_argument("--quiet", action="store_true")


def cmd_tune_layerskip(args: argparse.Namespace) -> int:
    from specdecode import DecoderConfig, SpecDecoder
    from specdecode.training.layer_search import calibration_prompts, tune_layerskip

    texts = read_prompt_lines(args.prompts, "--prompts") if args.prompts else calibration_prompts(args.per_category)
    try:
        skip_counts = [int(c) for c in args.skip_counts] if args.skip_counts else None
    except ValueError:
        raise InvalidRequestError(f"--skip-counts takes integers, got {','.join(args.skip_counts)}.") from None
    decoder = SpecDecoder.from_config(DecoderConfig.from_args(args, method="none", backend="torch"),
                                      show_progress=not args.quiet)
    chat = use_chat(decoder.tokenizer, args.chat)
    prompts = [decoder.encode(text, chat=chat) for text in texts]
    log = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr))
    choice = tune_layerskip(
        decoder, prompts, max_new_tokens=args.max_new_tokens,
        skip_counts=skip_counts, measure_top=args.measure_top, k_max=decoder.config.k_max, log=log,
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


def add_distill_parser(sub: argparse._SubParsersAction) -> None:
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


def cmd_distill(args: argparse.Namespace) -> int:
    from specdecode import SpecDecoder
    from specdecode.models.loader import load_model
    from specdecode.training import distill as d

    config = d.DistillConfig(
        out=Path(args.out), max_new_tokens=args.max_new_tokens, train_layers=args.train_layers, epochs=args.epochs,
        lr=args.lr, accumulate=args.accumulate, warmup_steps=args.warmup_steps, seed=args.seed, loss=args.loss, teacher_top_k=args.teacher_top_k,
        show_progress=not args.quiet,
    )
    train = read_prompt_lines(args.prompts, "--prompts") if args.prompts else d.held_apart_prompts(10, args.train_per_category)
    held = read_prompt_lines(args.eval_prompts, "--eval-prompts") if args.eval_prompts else d.held_apart_prompts(20, 2)
    overlap = set(train) & set(held)
    if overlap:
        raise InvalidRequestError(f"{len(overlap)} evaluation prompt(s) also appear among the training prompts; keep them apart.")
    base = SpecDecoder.from_pretrained(args.target, args.draft, method="draft", draft_confidence=0.0, backend="torch",
                                       dtype=args.dtype, device=args.device, show_progress=not args.quiet)
    assert base.draft is not None
    if config.train_layers > base.draft.config.num_layers:
        raise InvalidRequestError(f"--train-layers {config.train_layers} exceeds the draft's {base.draft.config.num_layers} layers.")
    chat = use_chat(base.tokenizer, args.chat)
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
        tuned = SpecDecoder(base.target, distilled, base.config)
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

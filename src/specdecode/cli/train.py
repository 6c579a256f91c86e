"""``specdecode train medusa|eagle``: the command line of ``train_heads``, and the tree options
that ``generate`` and ``bench`` share."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdecode.core.device import DEVICE_CHOICES, DTYPE_CHOICES


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type for counts (shared with ``cli``: this module is imported by it)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type for counts where 0 means "off"."""
    return _int_at_least(text, 0)


def add_bench_heads_arguments(parser: argparse.ArgumentParser) -> None:
    """bench's --medusa-heads and --eagle-heads (one run may benchmark both kinds of heads)."""
    parser.add_argument("--medusa-heads", help="medusa: a heads folder from `specdecode train medusa`")
    parser.add_argument("--eagle-heads", help="eagle: a heads folder from `specdecode train eagle`")


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.training.features import DEFAULT_MAX_TOKENS, DEFAULT_SEQ_LEN
    from specdecode.training.heads import DEFAULT_CE_WEIGHT, DEFAULT_DRAFT_VOCAB, DEFAULT_MEDUSA_HEADS, DEFAULT_NOISE

    parser = sub.add_parser(
        "train",
        help="train Medusa heads or an EAGLE head on the target's own features",
        description=(
            "Run the training text through the frozen target once (features cached on disk in shards, "
            "resumable), then train the heads against the target's own next-token distributions. "
            "Writes heads.json + heads.safetensors (for --heads), train_report.json and a checkpoint "
            "into --out; rerunning the same command resumes."
        ),
    )
    parser.add_argument("kind", choices=("medusa", "eagle"))
    parser.add_argument("--target", help="target model (default: demo 1.5B)")
    parser.add_argument(
        "--data", action="append", default=None,
        help="training text, repeatable: 'stdlib' (the Python standard library's source), a .jsonl of "
        "prompt_ids/answer_ids (`specdecode distill` data: the target's own answers) or text rows, "
        "a text file, or a folder of .py/.txt/.md files (default: stdlib)",
    )
    parser.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS, help="training tokens in all")
    parser.add_argument("--seq-len", type=positive_int, default=DEFAULT_SEQ_LEN, help="tokens per training sequence")
    parser.add_argument("--epochs", type=positive_int, default=None, help="default: 2 (medusa), 3 (eagle)")
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-3 (medusa), 3e-4 (eagle)")
    parser.add_argument("--heads", type=positive_int, default=DEFAULT_MEDUSA_HEADS, help="medusa: number of heads")
    parser.add_argument("--draft-vocab", type=positive_int, default=DEFAULT_DRAFT_VOCAB,
                        help="tokens the heads can propose (most frequent in the data first)")
    parser.add_argument("--tree-size", type=positive_int, default=12, help="medusa: nodes of the static tree built after training")
    parser.add_argument("--noise", type=float, default=DEFAULT_NOISE, help="eagle: input-feature noise, relative to their RMS")
    parser.add_argument("--ce-weight", type=float, default=DEFAULT_CE_WEIGHT, help="eagle: weight of the token loss next to the feature loss")
    parser.add_argument("--eval-fraction", type=float, default=0.1, help="sequences held apart for the accuracy report")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=list(DTYPE_CHOICES), default="auto", help="the target's dtype for features (training is fp32)")
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    parser.add_argument("--out", required=True, help="output folder (heads, features, checkpoint, report)")
    parser.add_argument("--quiet", action="store_true")


def cmd_train(args: argparse.Namespace) -> int:
    from specdecode.core.device import resolve_device, resolve_dtype
    from specdecode.models import demo
    from specdecode.training.heads import TrainConfig, train_for_target

    cfg = TrainConfig(
        kind=args.kind, epochs=args.epochs or 0, lr=args.lr or 0.0, seed=args.seed, num_heads=args.heads,
        draft_vocab=args.draft_vocab, eval_fraction=args.eval_fraction, noise=args.noise, ce_weight=args.ce_weight,
        tree_size=args.tree_size,
    )
    device = resolve_device(args.device)
    report = train_for_target(
        args.target or demo.DEFAULT_TARGET, args.data or ["stdlib"], Path(args.out), cfg, args.seq_len,
        args.max_tokens, resolve_dtype(args.dtype, device), device, show_progress=not args.quiet,
    )
    unit = "head" if args.kind == "medusa" else "depth"
    accuracy = " ".join(f"{a:.2f}" for a in report["accuracy"])
    print(f"{args.kind} heads saved to {args.out}: {report['train_tokens']} training tokens, "
          f"{report['train_seconds']:.0f} s training; held-apart top-1 accuracy per {unit}: {accuracy}", file=sys.stderr)
    return 0

"""``specdecode audit``: check that methods reproduce the target on the user's own models
(``audit/run.py``). Exit 0 when every check passes, 1 when one fails, 2 for bad input."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdecode.audit.run import AuditReport

EXIT_AUDIT_FAILED = 1
DEFAULT_NUM_PROMPTS = 3
DEFAULT_MAX_NEW_TOKENS = 64
# Every step drafts k, so every step is verified: the distribution test sees the acceptance rule
# at work on each sampled token.
AUDIT_DRAFT_CONFIDENCE = 0.0


def add_audit_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode import audit as a
    from specdecode.cli.args import add_decoder_arguments
    from specdecode.cli.train import positive_int

    parser = sub.add_parser(
        "audit",
        help="check that methods reproduce the target: greedy equality and a chi-square test of sampling",
        description=(
            "For each method: greedy output equal to plain decoding on each prompt (a difference is a "
            "near-tie only where the target's two tokens are within the near-tie threshold), and a "
            "chi-square test of the first sampled tokens against the target's exact distribution, with "
            "the test's power against a sampler that emits the drafter's tokens unchanged. The audit drafts "
            "a fixed k every step, so --draft-confidence defaults to 0 here (every step is verified). Exit status 0: "
            "every check passed; 1: a check failed; 2: bad input."
        ),
    )
    parser.add_argument(
        "--method", action="append", default=None, metavar="M",
        help="method(s) to audit, repeatable or comma-separated (default: draft,ngram with a draft model, else ngram)",
    )
    parser.add_argument("--prompts", default="default",
                        help="default (the shipped Spec-Bench rows, taken one category after another), a .jsonl file of "
                        "Spec-Bench rows (each row's first turn), or a text file, one prompt per line")
    parser.add_argument("--num-prompts", type=positive_int, default=DEFAULT_NUM_PROMPTS, help="prompts in the greedy check")
    parser.add_argument("--max-new-tokens", type=positive_int, default=DEFAULT_MAX_NEW_TOKENS, help="greedy tokens per prompt")
    parser.add_argument("--draws", type=int, default=a.DEFAULT_DRAWS, help="seeded generations in the distribution check")
    parser.add_argument("--sampled-tokens", type=int, default=a.DEFAULT_SAMPLED_TOKENS,
                        help="tokens per draw whose joint distribution is tested (top-k^T sequences are enumerated)")
    parser.add_argument("--top-k", type=int, default=a.DEFAULT_TOP_K, help="top-k of the sampling (temperature 1)")
    parser.add_argument("--near-tie", type=float, default=None,
                        help="a fixed near-tie threshold in logits (default: 5e-3 in fp32, 4 ulps of the top logit in bf16/fp16)")
    parser.add_argument("--alpha", type=float, default=a.DEFAULT_ALPHA, help="significance of the chi-square test")
    parser.add_argument("--seed", type=int, default=0, help="the first draw's seed (draw i uses seed + i)")
    parser.add_argument("--chat", choices=("auto", "yes", "no"), default="auto",
                        help="greedy prompts in the chat template (auto: when the tokenizer has one)")
    add_decoder_arguments(parser, exclude=frozenset({"method", "engine"}))
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object instead of tables")
    parser.add_argument("--out", help="also write the JSON report to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress bars on stderr")


def _methods(values: list[str] | None) -> tuple[str, ...] | None:
    if values is None:
        return None
    return tuple(dict.fromkeys(m.strip() for v in values for m in v.split(",") if m.strip()))


def _prompt_texts(source: str, count: int) -> list[tuple[str, str]]:
    """(prompt id, text) of the first ``count`` prompts: from a file, or the shipped Spec-Bench
    rows taken round-robin over their categories, so that a few prompts span kinds of text."""
    from specdecode.prompt_sets import DEFAULT_SOURCE, load_spec_bench, load_text_prompts

    if source != DEFAULT_SOURCE:
        path = Path(source)  # .jsonl: Spec-Bench rows, as the bench reads them
        prompts = load_spec_bench(path) if path.suffix == ".jsonl" else load_text_prompts(path)
        return [(p.prompt_id, p.turns[0]) for p in prompts[:count]]
    by_category: dict[str, list] = {}
    for prompt in load_spec_bench():
        by_category.setdefault(prompt.category, []).append(prompt)
    deepest = max(len(group) for group in by_category.values())
    ordered = [group[rank] for rank in range(deepest) for group in by_category.values() if rank < len(group)]
    return [(p.prompt_id, p.turns[0]) for p in ordered[:count]]


def cmd_audit(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from specdecode import DecoderConfig, SpecDecoder
    from specdecode import audit as a
    from specdecode.config import DEFAULT_K
    from specdecode.core import registry
    from specdecode.core.device import dtype_name, resolve_device, resolve_dtype
    from specdecode.drafters.layer_skip_file import builtin_choice
    from specdecode.errors import InvalidRequestError
    from specdecode.models import demo

    if args.k == "auto":
        raise InvalidRequestError("The audit checks a fixed draft length: pass --k N (default 5), not --k auto.")
    target = args.target or demo.DEFAULT_TARGET
    has_draft = args.draft is not None or demo.is_demo_model_name(target)
    lookup = registry.NGRAM.name
    methods = _methods(args.method) or ((registry.DRAFT.name, lookup) if has_draft else (lookup,))
    # Validate everything before loading: a typo should cost a second, not a model load.
    config = a.AuditConfig(methods=methods, max_new_tokens=args.max_new_tokens, draws=args.draws,
                           sampled_tokens=args.sampled_tokens, top_k=args.top_k, k=args.k or DEFAULT_K, seed=args.seed,
                           alpha=args.alpha, near_tie=args.near_tie,
                           precision=dtype_name(resolve_dtype(args.dtype or "auto", resolve_device(args.device or "auto"))))
    prompts = _prompt_texts(args.prompts, args.num_prompts)
    skip_layers = args.skip_layers
    needs = {registry.BY_NAME[m].needs for m in methods}  # AuditConfig checked the names
    if registry.NEEDS_SKIP_LAYERS in needs and not (skip_layers or args.layerskip_config):
        builtin = builtin_choice(target)
        if builtin is None:
            raise InvalidRequestError(
                f"--method layerskip needs the layers to skip for {target}: pass --skip-layers, or "
                f"--layerskip-config from `specdecode tune-layerskip --target {target}`."
            )
        skip_layers = builtin.skip_layers
    if registry.NEEDS_DRAFT_MODEL in needs and not has_draft:
        raise InvalidRequestError("--method draft needs a draft model: pass --draft (same tokenizer as --target).")
    if registry.NEEDS_HEADS in needs and not args.heads:
        raise InvalidRequestError("--method medusa/eagle needs --heads FOLDER (from `specdecode train`).")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise InvalidRequestError(f"--out {args.out}: its folder does not exist; create it first.")

    # One decoder serves every method: "draft" loads the draft model, "none" loads the target only.
    uses_draft = any(registry.BY_NAME[m].uses_draft_model for m in methods) and has_draft
    decoder_config = DecoderConfig.from_args(
        args, method=registry.DRAFT.name if uses_draft else registry.NONE.name, skip_layers=skip_layers or (),
        draft_confidence=AUDIT_DRAFT_CONFIDENCE if args.draft_confidence is None else args.draft_confidence,
    )
    decoder = SpecDecoder.from_config(decoder_config, show_progress=not args.quiet)
    if decoder.backend == "llama.cpp" and config.precision != "fp32":
        config = replace(config, precision="fp16")  # llama.cpp keeps an f16 KV cache unless asked for fp32
    chat = bool(getattr(decoder.tokenizer, "chat_template", None)) if args.chat == "auto" else args.chat == "yes"
    greedy_prompts = [(pid, decoder.encode(text, chat=chat)) for pid, text in prompts]
    report = a.run_audit(decoder, greedy_prompts, a.distribution_prompt(decoder, prompts[0][1]), config,
                         progress=_progress_bars(args.quiet))
    data = report.to_dict()
    if args.out:
        try:
            Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
        except OSError as err:
            raise InvalidRequestError(f"Cannot write --out {args.out}: {err}") from err
    if args.json:
        json.dump(data, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(render(report))
    return 0 if report.passed else EXIT_AUDIT_FAILED


def _progress_bars(quiet: bool) -> Callable[[Iterable, str], Iterable]:
    def progress(items: Iterable, label: str) -> Iterable:
        if quiet:
            return items
        from tqdm.auto import tqdm

        return tqdm(items, desc=label, file=sys.stderr, leave=False)

    return progress


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(report: AuditReport) -> str:
    """The report as plain-text tables for the terminal."""
    out = [f"audit: target {report.target}" + (f", draft {report.draft}" if report.draft else "")
           + f" ({report.backend}, {report.precision}); near-tie threshold {report.near_tie}", "",
           "Greedy: method output vs plain decoding"]
    rows = []
    for r in report.greedy:
        where = "" if r.position is None else f"@{r.position}: {r.plain_token} vs {r.method_token}"
        rows.append([r.prompt_id, r.method, r.verdict, f"{r.compared}/{r.tokens}", where,
                     _num(r.top2_gap, ".2e"), _num(r.token_gap, ".2e"), _num(r.threshold, ".1e")])
    out.append(_table(["prompt", "method", "verdict", "equal", "first difference", "top2 gap", "token gap", "threshold"], rows))
    config = report.config
    out += ["", (f"Distribution: first {config['sampled_tokens']} tokens, temperature 1, top-k {config['top_k']}, "
                 f"{config['draws']} draws, chi-square at p = {report.alpha:g}")]
    rows = []
    for r in report.distribution:
        source = r.critical_source.replace("built-in incomplete gamma", "built-in")
        critical = "-" if r.critical is None else f"{r.critical:.1f} ({source})"
        rows.append([r.method, r.verdict, _num(r.statistic, ".1f"), str(r.df), critical,
                     f"{r.accepted}/{r.proposed}", str(r.impossible), _num(r.q_statistic, ".1f"), _num(r.power, ".2f")])
    out.append(_table(["method", "verdict", "chi2", "df", "critical", "accepted", "impossible", "chi2 of q", "power"], rows))
    notes = [f"  {r.method}: {r.power_note}" for r in report.distribution if r.power_note]
    if notes:
        out += ["", "Power notes:", *notes]
    inconclusive = [r.method for r in report.distribution if r.verdict == "inconclusive"]
    if not report.passed:
        verdict = "FAIL: a lossless claim is broken (see the FAIL rows)"
    elif inconclusive:
        verdict = f"PASS, but the distribution check was inconclusive for {', '.join(inconclusive)} (see the notes)"
    else:
        verdict = "PASS: every check passed"
    out += ["", f"{verdict} ({report.seconds:.0f} s)"]
    return "\n".join(out)

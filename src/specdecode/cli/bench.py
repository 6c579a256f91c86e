"""``specdecode bench`` (methods side by side on prompt sets) and ``specdecode quality``."""

from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.cli.args import EXIT_INTERRUPTED, add_decoder_arguments, comma_list
from specdecode.cli.train import add_bench_heads_arguments
from specdecode.cli.train import positive_int as _positive_int
from specdecode.core.device import DEVICE_CHOICES, DTYPE_CHOICES
from specdecode.errors import InvalidRequestError

# Decoder options a bench run sets per method (bench/config.py: SET_PER_METHOD), in its labels
# (draft:3@int8, none@llama.cpp, ngram:auto, none+nocache) or with its own flags (--medusa-heads,
# --eagle-heads); and those bench has no flag for (a BenchConfig from Python takes them: its
# decoder is a whole DecoderConfig). Every other decoder flag is bench's too.
BENCH_UNFLAGGED = frozenset({"k_max", "acceptance", "suffix_cache_tokens", "retime_costs", "engine"})


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.bench.config import SET_PER_METHOD
    from specdecode.bench.llamacpp_bin import DEFAULT_BIN_TIMEOUT_SECONDS
    from specdecode.bench.methods import DEFAULT_HF_LOOKUP_TOKENS, DEFAULT_LLAMACPP_LOOKUP_TOKENS, available_methods
    from specdecode.bench.runner import DEFAULT_METHODS
    from specdecode.prompt_sets import CATEGORIES

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
    bench.add_argument(
        "--methods", type=comma_list, default=DEFAULT_METHODS,
        help=f"comma-separated, from: {', '.join(available_methods())}; a specdecode method may add weight "
        "quantizations: none@int8 (int8 target), draft@int8/int4 (int8 target, int4 draft), or run on the "
        "llama.cpp backend: none@llama.cpp, draft:3@llama.cpp (GGUF --target/--draft); a trailing +nocache "
        "prefills every turn whole (no prefix cache) "
        "(default: %(default)s)".replace("%(default)s", ",".join(DEFAULT_METHODS)),
    )
    bench.add_argument(
        "--prompts", type=comma_list, default=("default",),
        help="comma-separated sources: default (Spec-Bench dev subset + HumanEval), spec_bench, humaneval, "
        "agentic (multi-turn code-editing sessions), a Spec-Bench .jsonl file, or a text file with one prompt per line",
    )
    bench.add_argument(
        "--categories", type=comma_list, default=("all",),
        help=f"comma-separated categories or 'all' (default set: {', '.join(CATEGORIES)}; agentic set: agentic)",
    )
    bench.add_argument("--max-prompts-per-category", type=_positive_int, default=3, help="first N of each category's fixed order")
    bench.add_argument("--max-new-tokens", type=_positive_int, default=128, help="per turn")
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); equality is checked only then")
    bench.add_argument("--top-k", type=int, default=0)
    bench.add_argument("--top-p", type=float, default=1.0)
    bench.add_argument("--seed", type=int, default=0, help="sampling seed (each generation restarts from it)")
    # The methods' labels set the method, k policy, backend and quantizations per method.
    add_decoder_arguments(bench, exclude=frozenset(SET_PER_METHOD) | BENCH_UNFLAGGED)
    add_bench_heads_arguments(bench)
    bench.add_argument("--hf-lookup-tokens", type=_positive_int, default=DEFAULT_HF_LOOKUP_TOKENS, help="prompt_lookup_num_tokens for hf-lookup")
    bench.add_argument(
        "--llamacpp-lookup-tokens", type=_positive_int, default=DEFAULT_LLAMACPP_LOOKUP_TOKENS,
        help="num_pred_tokens for llamacpp-lookup (default %(default)s: llama-cpp-python's advice for CPUs)",
    )
    bench.add_argument(
        "--llamacpp-bin", metavar="DIR",
        help="folder holding llama.cpp's llama-speculative-simple and llama-lookup, for llamacpp-bin-draft and "
        "llamacpp-bin-lookup (build them with scripts/build-llamacpp-tools.sh in the repository)",
    )
    bench.add_argument(
        "--llamacpp-bin-timeout", type=float, default=DEFAULT_BIN_TIMEOUT_SECONDS,
        help="seconds one run of a llama.cpp binary may take (default %(default)s)",
    )
    bench.add_argument("--repeats", type=_positive_int, default=1, help="runs per prompt and method; the median-time run counts")
    bench.add_argument("--no-warmup", action="store_true", help="skip the warm-up prompt")
    bench.add_argument("--chat", choices=("auto", "yes", "no"), default="auto", help="use the chat template (auto: when the tokenizer has one)")
    bench.add_argument("--bandwidth-probe-mib", type=int, default=1024, help="size of the copy-bandwidth probe (0 = skip it and the ceilings)")
    bench.add_argument(
        "--from-results", metavar="RESULTS_JSON",
        help="measure nothing: recompute the summary, report and plots of a stored results.json with this "
        "version's report code, into --out",
    )
    bench.add_argument(
        "--oracle", action="store_true",
        help="also report the oracle ceiling: the hindsight-best schedule of the draft model, prompt lookup and "
        "suffix trees on each greedy output, priced with this machine's pass costs beside every method's own passes "
        "(needs none or none@llama.cpp in --methods; writes traces.json too)",
    )
    bench.add_argument("--out", default="results", help="output folder (default: %(default)s)")
    bench.add_argument("--no-plots", action="store_true")
    bench.add_argument("--quiet", action="store_true", help="no progress or tables")


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdecode.bench import BenchConfig, resummarize, run_bench
    from specdecode.config import DecoderConfig

    config = BenchConfig(
        decoder=DecoderConfig.from_args(args),  # the shared decoder flags, validated before anything loads
        methods=args.methods,
        prompts=args.prompts,
        categories=args.categories,
        max_prompts_per_category=args.max_prompts_per_category,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        medusa_heads=args.medusa_heads,
        eagle_heads=args.eagle_heads,
        hf_lookup_tokens=args.hf_lookup_tokens,
        llamacpp_lookup_tokens=args.llamacpp_lookup_tokens,
        llamacpp_bin=args.llamacpp_bin,
        llamacpp_bin_timeout=args.llamacpp_bin_timeout,
        repeats=args.repeats,
        warmup=not args.no_warmup,
        chat={"auto": None, "yes": True, "no": False}[args.chat],
        bandwidth_probe_bytes=max(0, args.bandwidth_probe_mib) << 20,
        oracle=args.oracle,
        out=Path(args.out),
        plots=not args.no_plots,
        quiet=args.quiet,
    )
    if args.from_results:
        resummarize(Path(args.from_results), config)
        return 0
    results = run_bench(config)
    return 0 if results["complete"] else EXIT_INTERRUPTED


def add_quality_parser(sub: argparse._SubParsersAction) -> None:
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
    quality.add_argument("--quants", type=comma_list, default=("int8", "int4"), help="comma-separated: int8, int4 (default: int8,int4)")
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

"""Argument types and argument groups shared by the commands."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from specdecode.cli.train import positive_int as _positive_int
from specdecode.config import DEFAULT_K_MAX, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN
from specdecode.errors import InvalidRequestError, reword_params
from specdecode.kv.static import KV_DTYPES

EXIT_USER_ERROR = 2  # bad input: one line on stderr
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it

# The library parameters a flag sets, as library errors name them (``errors.reword_params``).
# A flag is its parameter's name with dashes (``kv_dtype`` -> ``--kv-dtype``) unless listed in
# PARAM_FLAG_NAMES.
FLAG_PARAMS = frozenset({
    "acceptance", "accumulate", "alpha", "backend", "chat", "compile", "data", "device", "draft", "draft_quant", "draft_vocab",
    "draws", "dtype", "eagle_heads", "epochs", "eval_fraction", "heads", "hf_lookup_tokens", "k", "k_max",
    "kv_cache_tokens", "kv_dtype", "layerskip_config", "llamacpp_bin", "llamacpp_bin_timeout",
    "llamacpp_lookup_tokens", "loss", "lr", "max_new_tokens", "max_prompts_per_category", "max_tokens", "medusa_heads",
    "method", "near_tie", "num_heads", "quants", "repeats", "sampled_tokens", "seq_len", "skip_layers", "target",
    "target_quant", "teacher_top_k", "temperature", "top_k", "train_layers", "tree_size", "warmup_steps", "window",
    # serve --ray (serving/ray.py: RayOptions)
    "replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "max_ongoing_requests", "cpus_per_replica",
})
PARAM_FLAG_NAMES = {"num_heads": "--heads"}  # `specdecode train --heads N`
OFF_SWITCHES = {"plots": "--no-plots"}  # name=False as the switch that sets it
VALUE_FLAGS = {"compile": "--compile-mode"}  # name=value where the switch --name itself takes none


def param_as_flag(name: str, value: str) -> str | None:
    """``name=value`` as the command line writes it (``--name value``; ``--name`` alone for a
    switch or a parameter named without a value); None for a parameter no flag sets."""
    if name in OFF_SWITCHES and value == "False":
        return OFF_SWITCHES[name]
    if name not in FLAG_PARAMS:
        return None
    flag = PARAM_FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
    if value in ("", "True"):
        return flag
    return f"{VALUE_FLAGS.get(name, flag)} {shlex.quote(value)}"


def cli_message(err: BaseException) -> str:
    """An error's message with the library's parameters named as this command line's flags."""
    return reword_params(str(err), param_as_flag)


def read_prompt_lines(path: str, flag: str) -> list[str]:
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError as err:
        raise InvalidRequestError(f"Cannot read {flag} {path}: {err}") from err
    if not lines:
        raise InvalidRequestError(f"{flag} {path} has no prompts.")
    return lines


def use_chat(tokenizer: object, choice: str) -> bool:
    """--chat auto|yes|no: auto uses the chat template when the tokenizer has one."""
    return bool(getattr(tokenizer, "chat_template", None)) if choice == "auto" else choice == "yes"


def add_quant_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.quant.apply import QUANT_CHOICES

    parser.add_argument(
        "--target-quant", choices=QUANT_CHOICES, default="none",
        help="weight-only quantization of the target (int4 keeps a Q4_K GGUF's own blocks); changes the target's output",
    )
    parser.add_argument("--draft-quant", choices=QUANT_CHOICES, default="none", help="weight-only quantization of the draft")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto", help="KV-cache storage: auto (model dtype) or int8")


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.backends.compiled import COMPILE_MODES

    parser.add_argument(
        "--compile", action="store_true",
        help="compile the torch backend's repeated passes per shape (CUDA graphs on a GPU); compiled before "
        "the first request, minutes on a small CPU the first time, then from an on-disk cache (docs/compile.md)",
    )
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, help="with --compile: the torch.compile mode "
                        "(default: reduce-overhead on CUDA, default on the CPU)")


def compile_choice(args: argparse.Namespace) -> bool | str:
    """``compile=`` for the API from --compile and --compile-mode."""
    if args.compile_mode and not args.compile:
        raise InvalidRequestError("--compile-mode needs --compile.")
    return args.compile_mode or args.compile


def k_value(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def add_k_policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--k-policy", choices=("cost", "threshold"), default="cost",
        help="with --k auto: cost (maximise expected tokens per measured second; may choose plain steps) "
        "or threshold (k+1 above 80%% acceptance, minimum below 40%%, starting at 5)",
    )
    parser.add_argument("--k-max", type=_positive_int, default=DEFAULT_K_MAX, help="with --k auto: the most tokens drafted per step (suffix decoding may draft up to 32 on long matches)")


def add_ngram_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ngram-max", type=_positive_int, default=DEFAULT_NGRAM_MAX, help="ngram: longest n-gram matched")
    parser.add_argument("--ngram-min", type=_positive_int, default=DEFAULT_NGRAM_MIN, help="ngram: shortest n-gram matched")


def layer_list(text: str) -> tuple[int, ...]:
    from specdecode.training.layer_search import parse_skip_layers

    try:
        return parse_skip_layers(text)
    except InvalidRequestError as err:
        raise argparse.ArgumentTypeError(cli_message(err)) from None


def add_layerskip_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--skip-layers", type=layer_list, default=None,
        help="layerskip: target layers the draft skips, e.g. '4-9,12' (default: --layerskip-config, or the demo target's tuned choice)",
    )
    parser.add_argument("--layerskip-config", help="layerskip: a JSON file written by `specdecode tune-layerskip`")


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())

"""Argument types and argument groups shared by the commands."""

from __future__ import annotations

import argparse
import math
import shlex
from pathlib import Path

from specdecode.cli.train import non_negative_int as _non_negative_int
from specdecode.cli.train import positive_int as _positive_int
from specdecode.config import (
    ACCEPTANCE_RULES,
    BACKEND_CHOICES,
    COMPILE_MODES,
    DEFAULT_K,
    DTYPES,
    ENGINES,
    KV_DTYPES,
    METHODS,
    QUANTS,
    DecoderConfig,
)
from specdecode.core.device import DEVICES
from specdecode.core.registry import methods_help
from specdecode.errors import InvalidRequestError, reword_params

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


def k_value(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def layer_list(text: str) -> tuple[int, ...]:
    from specdecode.drafters.layer_skip_file import parse_skip_layers

    try:
        return parse_skip_layers(text)
    except InvalidRequestError as err:
        raise argparse.ArgumentTypeError(cli_message(err)) from None


def add_decoder_arguments(parser: argparse.ArgumentParser, *, exclude: frozenset[str] = frozenset(),
                          method_help: str | None = None) -> None:
    """Every ``DecoderConfig`` option as a flag, with one spelling and the config's defaults
    (``DecoderConfig.from_args`` reads them back; an absent flag keeps the config's default).

    Every command that loads a decoder (generate, serve, serve --ray, bench, audit,
    tune-layerskip) adds this group; ``exclude`` names the fields a command sets itself (bench
    and audit take a list of methods; tune-layerskip always runs the target on torch)."""
    d = DecoderConfig()
    group = parser.add_argument_group("decoder (the models, how they run, how they speculate)")

    def add(field: str, flag: str | None = None, **kwargs: object) -> None:
        if field not in exclude:
            group.add_argument(flag or "--" + field.replace("_", "-"), dest=field, default=None, **kwargs)

    add("target", help="the model whose output is reproduced: a demo name, .gguf file, HF folder or hub id "
        "(default: demo 1.5B)")
    add("draft", help="the small draft model, same tokenizer (default: demo 0.5B with the demo target)")
    add("method", choices=METHODS, help=method_help or f"default {d.method}. {methods_help()}")
    add("k", type=k_value, help=f"tokens drafted per step, or 'auto': chosen each step from live acceptance and "
        f"measured costs (default {DEFAULT_K}; auto on the llama.cpp backend)")
    add("k_policy", choices=("cost", "threshold"), help="how k is chosen per step: cost (maximise expected tokens per "
        "measured second; may choose plain steps; what --k auto means) or threshold (k+1 above 80%% acceptance, "
        "minimum below 40%%, starting at --k)")
    add("k_max", type=_positive_int, help=f"with --k auto: the most tokens drafted per step (default {d.k_max}; "
        "suffix decoding may draft up to 32 on long matches)")
    add("draft_confidence", type=float, help="stop drafting once the draft's probability for its token is below "
        f"this (0 = always draft k; default {d.draft_confidence})")
    add("ngram_max", type=_positive_int, help=f"ngram: longest n-gram matched (default {d.ngram_max})")
    add("ngram_min", type=_positive_int, help=f"ngram: shortest n-gram matched (default {d.ngram_min})")
    add("skip_layers", type=layer_list, help="layerskip: target layers the draft skips, e.g. '4-9,12' (default: "
        "--layerskip-config, or the demo target's tuned choice)")
    add("layerskip_config", help="layerskip: a JSON file written by `specdecode tune-layerskip`")
    add("heads", help="medusa/eagle: a heads folder from `specdecode train medusa|eagle`")
    add("tree_size", type=_positive_int, help="medusa/eagle/suffix: drafted tree nodes per step at most (default: "
        "Medusa sizes its tree from measured verify costs, EAGLE 4, suffix 16, or 32 with --k auto)")
    add("acceptance", choices=ACCEPTANCE_RULES, help="medusa/eagle: 'typical' is Medusa's typical acceptance, "
        "faster and LOSSY under sampling (the output no longer follows the target's distribution); default lossless")
    add("suffix_cache_tokens", type=_non_negative_int, help="response tokens kept for method suffix (and auto) over "
        f"all groups, least recently used evicted first (0: none; default {d.suffix_cache_tokens})")
    add("prefix_cache", "--no-prefix-cache", action="store_false", help="prefill every prompt whole instead of "
        "reusing the K/V of the prefix it shares with the previous request (on by default; "
        "docs/design.md#prefix-caching)")
    add("jump_forward", "--no-jump-forward", action="store_false", help="under a grammar or schema, do not draft "
        "the text it forces (on by default; docs/structured.md)")
    add("grammar_timeout", type=positive_float, help="seconds a request's grammar or schema may take to compile "
        f"(in a child process, stopped past it: the request gets an error naming it; default {d.grammar_timeout:g})")
    add("grammar_cache_bytes", type=_non_negative_int, help="bytes of compiled grammars kept for reuse, least "
        f"recently used dropped first (default {d.grammar_cache_bytes // 2**20} MiB)")
    add("retime_costs", action="store_true", help="time the passes the cost-aware draft length reads again, "
        "instead of the timings stored by an earlier run for the same model file, backend and machine")
    add("backend", choices=BACKEND_CHOICES, help="auto (default): llama.cpp for GGUF files on the CPU where "
        "llama-cpp-python is installed, else torch")
    add("dtype", choices=DTYPES, help="auto (default): bf16 where supported, else fp32; on llama.cpp fp32 keeps an "
        "f32 KV cache, anything else its f16 one")
    add("device", choices=DEVICES, help="auto (default): cuda where PyTorch sees one, else cpu")
    add("target_quant", choices=QUANTS, help="weight-only quantization of the target (int4 keeps a Q4_K GGUF's own "
        "blocks); changes the target's output")
    add("draft_quant", choices=QUANTS, help="weight-only quantization of the draft")
    add("kv_dtype", choices=KV_DTYPES, help="KV-cache storage: auto (model dtype, default) or int8")
    add("compile", action="store_true", help="compile the torch backend's repeated passes per shape (CUDA graphs "
        "on a GPU); compiled before the first request, minutes on a small CPU the first time, then from an on-disk "
        "cache (docs/compile.md)")
    add("engine", choices=ENGINES, help="which engine decodes: auto (default) or batch, the batch engine the server "
        "runs, holding one request; single, the single-request engine")
    if "compile" not in exclude:
        group.add_argument("--compile-mode", choices=COMPILE_MODES, help="with --compile: the torch.compile mode "
                           "(default: reduce-overhead on CUDA, default on the CPU)")


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value

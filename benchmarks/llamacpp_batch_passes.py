"""Seconds of one llama.cpp ``forward_batch`` by row shape and KV layout (issue 45 item 5).

    python benchmarks/llamacpp_batch_passes.py --repeats 7
    python benchmarks/llamacpp_batch_passes.py --repeats 5 --variant streams:512 --variant unified:512 --variant unified:64

The batch engine feeds every running row (a committed token and its drafts, or a prompt chunk)
as one flat ``llama_batch``. How llama.cpp cuts that batch into micro-batches ("ubatches", one
compute graph and one read of the weights each) depends on the context's KV layout: with one KV
stream per sequence (``kv_unified=False``) it uses ``split_equal``, which puts the same number
of tokens of each sequence in a ubatch and only sequences with consecutive ids; with one
unified stream it uses ``split_simple``, up to ``n_ubatch`` tokens in batch order.

Each variant (``LAYOUT:N_UBATCH``, LAYOUT ``streams`` or ``unified``) is a context on the same
loaded weights with 16 sequences: sequences 0..7 hold ``--context`` cached positions and take
the decode rows, 8..15 take the prompts. Shapes: B equal rows of T tokens; ragged rows; equal
rows on non-consecutive sequence ids; 8 prompts of 41-58 tokens prefilled together. Variants
are interleaved shape by shape and repeat by repeat; medians are printed. The ubatch count of
each shape is read from llama.cpp's own batch log (``LLAMA_BATCH_DEBUG``) in a separate
context of the same variant, so the conclusion does not rest on timings alone.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass

from specdecode.backends.llamacpp import LlamaCppModel, llama_cpp_version
from specdecode.backends.llamacpp_binding import LogSink, import_llama_cpp
from specdecode.models.demo import DEFAULT_TARGET, demo_model_path

DECODE_SEQS = range(8)  # hold --context positions; the decode rows go here
PROMPT_SEQS = range(8, 16)  # the prompts are prefilled here from position 0
PROMPT_LENGTHS = (44, 47, 50, 52, 55, 49, 58, 41)  # ~50 tokens, all different (400 in all)
UBATCH_LOG_LINE = "added ubatch to split"  # llama-batch.cpp's ubatch_add, with LLAMA_BATCH_DEBUG >= 1


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    rows: tuple[tuple[int, int], ...]  # (sequence id, tokens)
    prefill: bool = False  # from position 0, logits of the last token; else after the cached context


def shapes() -> list[Shape]:
    out = [Shape(f"1x{t}", ((0, t),)) for t in (1, 8)]  # one row: the floor each ubatch costs
    out += [Shape(f"{b}x{t}", tuple((s, t) for s in range(b))) for b in (4, 8) for t in (1, 2, 4, 8)]
    out += [Shape("ragged " + "/".join(map(str, lengths)), tuple(enumerate(lengths)))
            for lengths in ((5, 3, 1, 1), (8, 1, 1, 1), (6, 1, 3, 1, 8, 2, 1, 4))]
    out.append(Shape("4x4 on seqs 0,2,4,6", tuple((s, 4) for s in (0, 2, 4, 6))))
    out.append(Shape("4x4 on seqs 3,2,1,0", tuple((s, 4) for s in (3, 2, 1, 0))))
    out.append(Shape("8 prompts 41-58", tuple(zip(PROMPT_SEQS, PROMPT_LENGTHS, strict=True)), prefill=True))
    return out


def requests(shape: Shape, context: int, rng: random.Random, vocab: int) -> list[tuple[int, list[int], int, str]]:
    return [(seq, [rng.randrange(vocab) for _ in range(count)], 0 if shape.prefill else context,
             "last" if shape.prefill else "all") for seq, count in shape.rows]


def parse_variant(text: str) -> tuple[str, bool, int]:
    layout, _, ubatch = text.partition(":")
    if layout not in ("streams", "unified"):
        raise SystemExit(f"--variant {text!r}: the layout is 'streams' or 'unified'")
    return text, layout == "unified", int(ubatch or 512)


def new_context(path, weights: LlamaCppModel | None, unified: bool, ubatch: int, n_ctx: int, threads: int | None) -> LlamaCppModel:
    return LlamaCppModel(path, n_ctx=n_ctx, n_seq_max=len(DECODE_SEQS) + len(PROMPT_SEQS), n_threads=threads,
                         n_batch=512, n_ubatch=ubatch, kv_unified=unified, weights_of=weights)


def fill_context(model: LlamaCppModel, context: int, rng: random.Random) -> None:
    for seq in DECODE_SEQS:  # one sequence per pass: the filling itself is not measured
        model.forward(seq, [rng.randrange(model.vocab_size) for _ in range(context)], 0, "none")


def count_ubatches(path, weights: LlamaCppModel, variants, context: int, threads: int | None) -> dict[tuple[str, str], int]:
    """llama.cpp's own count of the ubatches each shape's llama_decode ran, per variant."""
    llama_cpp = import_llama_cpp()
    lines: list[str] = []

    def log(level: int, text: bytes | None, user_data: int | None) -> None:
        if text and UBATCH_LOG_LINE in text.decode("utf-8", errors="replace"):
            lines.append("ubatch")

    callback = llama_cpp.llama_log_callback(log)
    counts: dict[tuple[str, str], int] = {}
    os.environ["LLAMA_BATCH_DEBUG"] = "1"  # read when a context is created
    try:
        for name, unified, ubatch in variants:
            rng = random.Random(0)
            model = new_context(path, weights, unified, ubatch, context + 64, threads)
            del os.environ["LLAMA_BATCH_DEBUG"]
            try:
                fill_context(model, context, rng)
                llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
                for shape in shapes():
                    lines.clear()
                    model.forward_batch(requests(shape, context, rng, model.vocab_size))
                    counts[(name, shape.name)] = len(lines)
            finally:
                LogSink.install(llama_cpp)
                model.close()
            os.environ["LLAMA_BATCH_DEBUG"] = "1"
    finally:
        os.environ.pop("LLAMA_BATCH_DEBUG", None)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the demo target)")
    parser.add_argument("--context", type=int, default=300, help="cached positions of each decoding sequence")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--variant", action="append", default=None,
                        help="LAYOUT:N_UBATCH, LAYOUT streams or unified (default: streams:512 and unified:512)")
    args = parser.parse_args()
    path = args.model or demo_model_path(DEFAULT_TARGET)
    variants = [parse_variant(v) for v in (args.variant or ["streams:512", "unified:512"])]

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, llama-cpp-python {llama_cpp_version()}, "
          f"model {os.path.basename(path)}, context {args.context}, repeats {args.repeats}, load {os.getloadavg()[0]:.2f}")
    base = new_context(path, None, False, 512, 64, args.threads)
    counts = count_ubatches(path, base, variants, args.context, args.threads)
    models = {}
    for name, unified, ubatch in variants:
        models[name] = new_context(path, base, unified, ubatch, args.context + 64, args.threads)
        fill_context(models[name], args.context, random.Random(0))
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in counts}
    rng = random.Random(1)
    for repeat in range(args.repeats + 1):  # the first round warms up and is not kept
        for shape in shapes():
            batch = requests(shape, args.context, rng, base.vocab_size)
            order = variants if repeat % 2 == 0 else variants[::-1]
            for name, _, _ in order:
                started = time.perf_counter()
                models[name].forward_batch(batch)
                if repeat:
                    seconds[(name, shape.name)].append(time.perf_counter() - started)

    names = [name for name, _, _ in variants]
    print(f"{'shape':<24}{'tokens':>7}" + "".join(f"{name + ' s':>16}{'ubatches':>9}" for name in names))
    for shape in shapes():
        tokens = sum(count for _, count in shape.rows)
        cells = "".join(f"{statistics.median(seconds[(name, shape.name)]):>16.3f}{counts[(name, shape.name)]:>9}" for name in names)
        print(f"{shape.name:<24}{tokens:>7}{cells}")
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    for model in models.values():
        model.close()
    base.close()


if __name__ == "__main__":
    main()

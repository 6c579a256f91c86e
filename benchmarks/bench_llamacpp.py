"""Cost of one llama.cpp pass against the rows it scores, and plain llama.cpp generation speed.

Speculative decoding on llama.cpp pays off when a (k + 1)-row verify pass costs little more
than a one-row decode step. This times ``LlamaCppModel.forward`` for 1 and k + 1 rows after a
prefill (median of repeats; each repeat truncates back to the prefill, as a rejected draft
does), then times llama-cpp-python's high-level ``Llama.generate`` for plain greedy decoding
with the same threads, KV type and attention kernel, as the baseline to beat.

    python benchmarks/bench_llamacpp.py path/to/model.gguf
    python benchmarks/bench_llamacpp.py path/to/model.gguf --k 2,4,6 --threads 8 --kv-type f32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from specdecode.backends.llamacpp import LlamaCppModel, physical_core_count

PREFILL_TOKENS = 150
GENERATE_TOKENS = 64
SEED = 0


def time_forward(model: LlamaCppModel, prefill: list[int], rows: int, repeats: int) -> float:
    """Median milliseconds of one ``rows``-token pass with logits for every row."""
    rng = random.Random(SEED + rows)
    times = []
    for _ in range(repeats + 1):  # the first pass warms caches and is dropped
        draft = [rng.randrange(model.vocab_size) for _ in range(rows)]
        begin = time.perf_counter()
        model.forward(0, draft, len(prefill), "all")
        times.append(time.perf_counter() - begin)
        model.truncate(0, len(prefill))
    return 1000 * statistics.median(times[1:])


def plain_generation_tok_s(path: str, prefill: list[int], args: argparse.Namespace) -> float:
    """Greedy decode speed of llama_cpp.Llama (tokens/s after the first token)."""
    import llama_cpp

    kv = llama_cpp.GGML_TYPE_F16 if args.kv_type == "f16" else llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(
        model_path=path, n_ctx=args.n_ctx, n_batch=512, n_threads=args.threads, n_threads_batch=args.threads,
        n_gpu_layers=0, flash_attn=args.flash_attn == "on", type_k=kv, type_v=kv, verbose=False,
    )
    try:
        stamps = []
        # generate() never stops on its own (no eos check): count the tokens we want.
        for _ in llm.generate(prefill, top_k=1, top_p=1.0, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == GENERATE_TOKENS:
                break
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", help="path to a GGUF model file")
    parser.add_argument("--k", default="4", help="draft lengths to time k + 1 rows for, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=physical_core_count())
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--kv-type", choices=["f16", "f32"], default="f16")
    parser.add_argument("--flash-attn", choices=["on", "off"], default="off")
    parser.add_argument("--skip-generate", action="store_true", help="do not time llama_cpp.Llama")
    args = parser.parse_args()
    draft_lengths = [int(k) for k in args.k.split(",")]

    with LlamaCppModel(
        args.gguf, n_ctx=args.n_ctx, n_threads=args.threads, kv_type=args.kv_type,
        flash_attn=args.flash_attn == "on",
    ) as model:
        rng = random.Random(SEED)
        prefill = [rng.randrange(model.vocab_size) for _ in range(PREFILL_TOKENS)]
        begin = time.perf_counter()
        model.forward(0, prefill, 0, "none")
        prefill_ms = 1000 * (time.perf_counter() - begin)
        print(f"{args.gguf}: threads {args.threads}, kv {args.kv_type}, flash attention {args.flash_attn}")
        print(f"prefill {PREFILL_TOKENS} tokens: {prefill_ms:.1f} ms")
        one_row = time_forward(model, prefill, 1, args.repeats)
        print(f"forward  1 row : {one_row:8.2f} ms/pass  ({1000 / one_row:.1f} passes/s)")
        for k in draft_lengths:
            rows_ms = time_forward(model, prefill, k + 1, args.repeats)
            print(f"forward {k + 1:2d} rows: {rows_ms:8.2f} ms/pass  ({rows_ms / one_row:.2f}x one row)")
    if not args.skip_generate:
        tok_s = plain_generation_tok_s(args.gguf, prefill, args)
        print(f"llama_cpp.Llama greedy, {GENERATE_TOKENS} tokens: {tok_s:.1f} tok/s")


if __name__ == "__main__":
    main()

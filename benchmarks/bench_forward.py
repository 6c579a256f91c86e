"""Cost of one forward pass against the number of tokens it scores.

Speculative decoding pays off when verifying k + 1 tokens costs about as much as scoring one:
this prints the median time of a cached forward for 1..N tokens after a prefill, for each
model, with and without bf16 prepacking, which is what the default k and the
``models/layers.py`` figures in the README rest on.

    python benchmarks/bench_forward.py                       # the demo pair
    python benchmarks/bench_forward.py --model path/or/name --rows 1,2,4,6,7,8
    python benchmarks/bench_forward.py --quant int8 --rows 1,6   # int8 weights, native kernel
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.core.device import resolve_dtype
from specdecode.kv.static import KVCache
from specdecode.models import demo
from specdecode.models.loader import gguf_source, load_weights, read_model_config, resolve_model_folder

PREFILL_TOKENS = 150
REPEATS = 7


def time_forward(model, rows: int) -> float:
    cfg = model.config
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, PREFILL_TOKENS + 32, model.dtype, model.device)
    ids = (torch.arange(PREFILL_TOKENS + rows)[None] * 7) % cfg.vocab_size
    with torch.inference_mode():
        model.extend(cache, ids[:, :PREFILL_TOKENS], 0, compute_logits=False)
        times = []
        for repeat in range(REPEATS + 2):
            started = time.perf_counter()
            model.extend(cache, ids[:, PREFILL_TOKENS:], PREFILL_TOKENS)
            if repeat >= 2:  # the first calls create kernels for the new shape
                times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="model name/path (repeatable; default: the demo pair)")
    parser.add_argument("--rows", default="1,2,4,5,6,7,8,9", help="token counts to time")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quant", choices=("none", "int8", "int4"), default="none", help="weight quantization (quantized layers have no bf16 packing)")
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    rows = [int(r) for r in args.rows.split(",")]
    for name in args.model or [demo.DEFAULT_TARGET, demo.DEFAULT_DRAFT]:
        folder = resolve_model_folder(name, dtype)
        cfg = read_model_config(folder)
        gguf_path = gguf_source(name, show_progress=False) if args.quant == "int4" else None
        for pack in (True, False) if args.quant == "none" else (True,):
            model = load_weights(folder, cfg, dtype, torch.device("cpu"), pack=pack, quant=args.quant, gguf_path=gguf_path)
            costs = {r: time_forward(model, r) for r in rows}
            base = costs[rows[0]]
            line = "  ".join(f"{r}:{c:.1f}ms({c / base:.2f}x)" for r, c in costs.items())
            print(f"{name} {dtype} quant={args.quant} packed={pack}: {line}", flush=True)
            del model


if __name__ == "__main__":
    main()

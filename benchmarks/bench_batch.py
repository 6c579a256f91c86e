"""Cost of batched forward passes through the paged KV cache, and the share of the gather.

    python benchmarks/bench_batch.py [--context 200] [--repeats 5]

For the demo target and draft: the median seconds of one forward pass of B sequences x T new
tokens each (every sequence holding ``--context`` cached tokens in a paged pool of 16-token
blocks), and the median seconds of the pass's KV gather alone (every layer's ``PagedView.read``),
which is what reading through block tables costs over the static cache's slice.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode import SpecDecoder
from specdecode.kv.paged import PagedKVCache, blocks_for


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (first call per shape)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--tokens", default="1,4")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    widths = [int(t) for t in args.tokens.split(",")]
    decoder = SpecDecoder.from_pretrained(show_progress=False)
    for name, model in (("target", decoder.target.model), ("draft", decoder.draft.model)):
        per_sequence = blocks_for(args.context + max(widths), 16)
        pool = PagedKVCache(model.config, max(batches) * per_sequence + 1, model.dtype, model.device, 16)
        for seq in range(max(batches)):
            pool.add(seq)
            pool.reserve(seq, args.context + max(widths))
            pool.commit(seq, args.context)  # frees the blocks past the context, so reserve again
            pool.reserve(seq, args.context + max(widths))
        print(f"{name}: context {args.context}, median of {args.repeats}")
        print("  B   T   pass ms  gather ms  gather share")
        for batch in batches:
            for width in widths:
                rows = [list(range(args.context, args.context + width))] * batch
                view, positions = pool.view(list(range(batch)), rows)
                tokens = torch.zeros((batch, width), dtype=torch.long, device=model.device)
                forward = median_seconds(lambda: model(tokens, positions, view, view), args.repeats)
                layers = model.config.num_layers
                gather = median_seconds(lambda: [view.read(layer, view.kv_len) for layer in range(layers)], args.repeats)
                print(f"{batch:>3} {width:>3} {forward * 1000:9.0f} {gather * 1000:10.1f} {gather / forward:12.1%}")


if __name__ == "__main__":
    main()

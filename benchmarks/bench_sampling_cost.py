"""Milliseconds per decoded token, greedy and sampled, on the single-request path: what drawing
from the target's distribution costs on top of the pass (core/categorical.py, top-p in
core/sampling.py). Prints one JSON line; run it once per code version and compare.

    python benchmarks/bench_sampling_cost.py --label new
    PYTHONPATH=/path/to/old/checkout/src python benchmarks/bench_sampling_cost.py --label old
"""

from __future__ import annotations

import argparse
import json

import specdecode
from specdecode import SamplingParams, SpecDecoder

CONFIGS = {
    "greedy": {"temperature": 0.0},
    "T1.0": {"temperature": 1.0},  # the OpenAI API's default
    "T0.8 top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="run")
    parser.add_argument("--target", default=None, help="default: the demo target")
    parser.add_argument("--backend", default="llama.cpp")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    dec = SpecDecoder.from_pretrained(args.target, method="none", backend=args.backend, show_progress=False)
    prompt = dec.encode("Write a quicksort in Python", chat=True)
    dec.generate(prompt, SamplingParams(max_new_tokens=8))  # warm-up; the prompt is cached after
    out: dict[str, object] = {"label": args.label, "package": specdecode.__file__}
    for name, fields in CONFIGS.items():
        per_token = []
        for repeat in range(args.repeats):
            seed = repeat if fields["temperature"] else None
            params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=seed, **fields)
            stats = dec.generate(prompt, params).stats
            per_token.append((stats.total_seconds - stats.prefill_seconds) / max(1, stats.new_tokens - 1) * 1e3)
        out[name] = per_token
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

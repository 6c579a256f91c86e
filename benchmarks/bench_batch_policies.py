"""The batch engine's policies side by side, offline: plain, async and sync with a fixed k, and
the cost-aware draft length, on the same chat prompts at one batch size; and the
single-sequence engine decoding them one after another, for reference.

    python benchmarks/bench_batch_policies.py --batch 4 --k 4 --max-tokens 64 --repeats 2

Every variant generates for ``--batch`` prompts at once (greedy) through ``generate_batch``;
variants take turns within each repeat. Reported: aggregate tokens/s (median over repeats,
and as a ratio to plain), tau pooled over the requests (the bonus token counted), and whether
each variant's token ids equal plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specdecode import SamplingParams, SpecDecoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import PROMPTS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    decoder = SpecDecoder.from_pretrained(show_progress=False)
    prompts = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.max_tokens)
    engines = {
        "async": decoder.batch_engine(max_batch=args.batch, cost_aware=False),
        "sync": decoder.batch_engine(max_batch=args.batch, cost_aware=False, policy="sync"),
        "cost-aware": decoder.batch_engine(max_batch=args.batch),
    }
    variants = [("plain", "none", engines["async"]), (f"async k={args.k}", "draft", engines["async"]),
                (f"sync k={args.k}", "draft", engines["sync"]), ("async, cost-aware k", "draft", engines["cost-aware"]),
                (f"one at a time, k={args.k}", "draft", None)]
    decoder.generate_batch(prompts, SamplingParams(max_new_tokens=4), method="none", engine=engines["async"])  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    for _ in range(args.repeats):
        for name, method, engine in variants:
            started = time.perf_counter()
            if engine is None:  # the single-sequence engine, requests one after another
                results = [decoder.generate(prompt, params, chat=True, method=method, k=args.k) for prompt in prompts]
            else:
                results = decoder.generate_batch(prompts, params, chat=True, method=method, k=args.k, engine=engine)
            seconds = time.perf_counter() - started
            tokens = sum(len(r.token_ids) for r in results)
            steps = sum(r.stats.verify_steps for r in results)
            runs[name].append({"tokens_per_second": tokens / seconds, "tau": sum(r.stats.emitted_by_steps for r in results) / steps,
                               "token_ids": [r.token_ids for r in results]})
    plain_rate = statistics.median(r["tokens_per_second"] for r in runs["plain"])
    rows = []
    print(f"batch {args.batch}, {args.max_tokens} tokens, median of {args.repeats}")
    for name, _, _ in variants:
        rate = statistics.median(r["tokens_per_second"] for r in runs[name])
        tau = statistics.median(r["tau"] for r in runs[name])
        same = all(r["token_ids"] == runs["plain"][0]["token_ids"] for r in runs[name])
        rows.append({"variant": name, "tokens_per_second": rate, "speedup": rate / plain_rate, "tau": tau, "equal_to_plain": same})
        print(f"{name:>22}  {rate:6.2f} tok/s  {rate / plain_rate:5.2f}x  tau {tau:4.2f}  equal to plain: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

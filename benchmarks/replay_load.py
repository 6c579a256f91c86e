"""The load test's order replayed offline through one batch worker, with every step's k.

    python benchmarks/replay_load.py [--repeats 1] [--max-tokens 48]

Like ``load_test.py --methods none,draft --concurrency 1,4`` against ``specdecode serve
--max-batch 16`` (the demo pair, cost-aware batch k), without HTTP: for each concurrency, plain
then speculative requests (the load test's chat prompts), sent together by threads. Prints
each level's aggregate tokens/s, times to first token, and how many steps ran at each
(batch size, k), with the first steps' rows as the chooser saw them: (acceptance, observed,
draft backlog). It shows what the batch's draft length did, which the load test cannot.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from specdecode import SamplingParams, SpecDecoder
from specdecode.costs.batch_k import BatchK
from specdecode.serving.worker import BatchWorker

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import PROMPTS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", default="1,4")
    args = parser.parse_args()
    decoder = SpecDecoder.from_pretrained(show_progress=False)
    engine = decoder.batch_engine(max_batch=16)
    steps: list[tuple[int, int, list]] = []
    choose = BatchK.choose

    def traced(chooser: BatchK, rows, batch_size: int) -> int:  # noqa: ANN001
        k = choose(chooser, rows, batch_size)
        steps.append((batch_size, k, [(round(r.acceptance, 2), r.observed, r.backlog) for r in rows]))
        return k

    BatchK.choose = traced  # the replay's own trace; the engine's code is unchanged
    worker = BatchWorker(engine)
    params = SamplingParams(max_new_tokens=args.max_tokens)
    prompts = [decoder.encode([{"role": "user", "content": p}], chat=True) for p in PROMPTS]

    def one(index: int, method: str, out: list) -> None:
        started, first, count = time.perf_counter(), None, 0
        chunks, _ = worker.submit(prompts[index % len(prompts)], params, method)
        for chunk in chunks:
            first = first if first is not None else time.perf_counter() - started
            count += len(chunk)
        out.append((first, count))

    for repeat in range(args.repeats):
        rates = {}
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for method in ("none", "draft"):
                out: list = []
                mark, started = len(steps), time.perf_counter()
                for first_request in range(0, max(4, concurrency), concurrency):
                    threads = [threading.Thread(target=one, args=(repeat + first_request + j, method, out))
                               for j in range(concurrency)]
                    for thread in threads:
                        thread.start()
                    for thread in threads:
                        thread.join()
                wall = time.perf_counter() - started
                rates[method, concurrency] = sum(n for _, n in out) / wall
                shapes = dict(sorted(Counter((b, k) for b, k, _ in steps[mark:]).items()))
                print(f"{method:>5} c={concurrency}: {rates[method, concurrency]:.2f} tok/s, TTFT "
                      f"{[round(t, 2) for t, _ in out]} s, steps by (batch, k): {shapes}", flush=True)
                for batch, k, rows in steps[mark : mark + 3]:
                    print(f"        batch {batch} k {k} rows {rows}")
            print(f"draft / none at c={concurrency}: {rates['draft', concurrency] / rates['none', concurrency]:.2f}x", flush=True)


if __name__ == "__main__":
    main()

"""Whether one thread's OpenMP team slows another's passes (backends/openmp.py): the same
request greedy, sampled, greedy again after the sampled runs, and greedy from a second thread
after the main thread's, on one decoder in one process, with the process's thread count.

    python benchmarks/bench_openmp_threads.py --max-new-tokens 64 --repeats 2

Before the release of idle teams, greedy runs after a sampled one, and runs from a second
thread, were ~30% slower on two cores (RESULTS 2026-12-04).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from specdecode import SamplingParams, SpecDecoder

PROMPT = "Write a quicksort in Python and explain it."


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--backend", default="llama.cpp")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    dec = SpecDecoder.from_pretrained(args.target, method="none", backend=args.backend, show_progress=False)
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=1)

    def run(label: str, params: SamplingParams) -> None:
        for _ in range(args.repeats):
            dec.forget_prefix()
            started = time.perf_counter()
            dec.generate(PROMPT, params)
            print(f"{label:38s} {time.perf_counter() - started:.3f} s  threads {task_count()}", flush=True)

    run("greedy, main thread", greedy)
    run("sampled, main thread", sampled)
    run("greedy, main thread, after sampling", greedy)
    side = threading.Thread(target=run, args=("greedy, a second thread", greedy))
    side.start()
    side.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

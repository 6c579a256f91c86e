"""Fair scheduling in the library, without HTTP: long requests outnumbering the batch's seats,
short ones arriving at given steps; total time, step times and each short request's wait.

    python benchmarks/fair_scheduling.py --time-slice 16 --tokens 128 --short-at 40,70,100
    python benchmarks/fair_scheduling.py --time-slice 0 --tokens 128 --short-at 40,70,100

The demo target on llama.cpp, method none, greedy, its end tokens banned (so every long request
runs its full length). Measures what ``benchmarks/load_test.py --fairness`` measures through the
server, in one process and back to back, where this machine's noise is smaller.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdecode import SamplingParams, SchedulerConfig, SpecDecoder

LONG_PROMPT = "Count from 1 to 2000, one number per line, with nothing else."
SHORT_PROMPT = "Say hi."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time-slice", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens of each long request")
    parser.add_argument("--long-requests", type=int, default=10)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--short-at", default="40,70,100", help="steps at which a short request arrives")
    parser.add_argument("--ban-tokens", default="151643,151645", help="the demo models' end tokens")
    args = parser.parse_args()
    dec = SpecDecoder.from_pretrained(backend="llama.cpp", method="none", show_progress=False)
    engine = dec.batch_engine(max_batch=args.max_batch, scheduling=SchedulerConfig(time_slice=args.time_slice))
    ban = {int(t): -100.0 for t in args.ban_tokens.split(",") if t}
    long_params = SamplingParams(max_new_tokens=args.tokens, logit_bias=ban)
    for i in range(args.long_requests):
        prompt = dec.encode([{"role": "user", "content": f"{LONG_PROMPT} (list {i})"}], chat=True)
        engine.add_request(prompt, long_params, "none")
    short_ids = dec.encode([{"role": "user", "content": SHORT_PROMPT}], chat=True)
    arrivals = {int(s) for s in args.short_at.split(",") if s}
    shorts: dict[str, list] = {}  # id -> [arrival step, first-token step, seconds]
    steps: list[float] = []
    started = time.perf_counter()
    while engine.has_unfinished:
        if len(steps) + 1 in arrivals:
            request_id = engine.add_request(short_ids, SamplingParams(max_new_tokens=4), "none")
            shorts[request_id] = [len(steps) + 1, None, time.perf_counter()]
        begun = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - begun)
        for output in outputs:
            entry = shorts.get(output.request_id)
            if entry is not None and entry[1] is None and output.new_tokens:
                entry[1], entry[2] = len(steps), time.perf_counter() - entry[2]
    total = time.perf_counter() - started
    pool = engine.target_cache
    print(f"time_slice={args.time_slice}: {total:.1f} s, {len(steps)} steps (median {statistics.median(steps) * 1000:.0f} ms), "
          f"fair preemptions {engine.scheduler.fair_preemptions}, swaps {getattr(pool, 'swaps', 0)}, "
          f"prefix hits {pool.prefix_stats.hit_tokens} positions")
    for arrival, first, seconds in shorts.values():
        print(f"short request: arrived at step {arrival}, first token at step {first}, after {seconds:.2f} s")


if __name__ == "__main__":
    main()

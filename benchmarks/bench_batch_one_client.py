"""One client's request four ways on the same decoder: the single-request engine, the same from
a second thread, the batch engine called in this thread, and the batch engine driven by
``BatchWorker``'s thread (as the server drives it). Issue 29 item 5: where the server's batch
path lost time for one client (passes from a second thread: backends/llamacpp_threads.py).

    python benchmarks/bench_batch_one_client.py --repeats 3 --max-new-tokens 96

Greedy (or sampled with ``--temperature``), plain decoding (method none), the demo pair's
target by default, the prefix cache dropped before each run so that every run prefills the
same prompt.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from specdecode import SamplingParams, SpecDecoder
from specdecode.serving.worker import BatchWorker


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0, help="above 0: sampled (seed 0 per run)")
    args = parser.parse_args()
    dec = SpecDecoder.from_pretrained(args.target, method="none", backend=args.backend, show_progress=False)
    engine = dec.batch_engine(max_batch=8)
    worker = BatchWorker(dec.batch_engine(max_batch=8))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, temperature=args.temperature,
                            seed=0 if args.temperature > 0 else None)
    prompt = dec.encode("Write a quicksort in Python", chat=True)
    times: dict[str, list[float]] = {"single": [], "thread": [], "batch": [], "worker": []}
    outputs = {}
    try:
        for _ in range(args.repeats):
            dec.forget_prefix()
            started = time.perf_counter()
            outputs["single"] = dec.generate(prompt, params).token_ids
            times["single"].append(time.perf_counter() - started)
            dec.forget_prefix()
            started = time.perf_counter()
            side = threading.Thread(target=lambda: outputs.__setitem__("thread", dec.generate(prompt, params).token_ids))
            side.start()
            side.join()
            times["thread"].append(time.perf_counter() - started)
            started = time.perf_counter()
            outputs["batch"] = dec.generate_batch([prompt], params, engine=engine)[0].token_ids
            times["batch"].append(time.perf_counter() - started)
            started = time.perf_counter()
            chunks, _ = worker.submit(prompt, params, "none")
            outputs["worker"] = [t for chunk in chunks for t in chunk]
            times["worker"].append(time.perf_counter() - started)
    finally:
        worker.close()
    single = statistics.median(times["single"])
    for name, values in times.items():
        print(f"{name:7s} median {statistics.median(values):.2f} s ({', '.join(f'{v:.2f}' for v in values)}), "
              f"{statistics.median(values) / single:.2f}x single, same tokens: {outputs[name] == outputs['single']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

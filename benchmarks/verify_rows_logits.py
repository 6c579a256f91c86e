"""What a verify pass's logit rows cost on llama.cpp: the demo target's pass over r rows with
logits for every row (a verify pass), for the last row only (what ``llama-bench -p r`` times),
and for none, at the same context.

Greedy and sampled verification need every row's logits: each row's output projection
(vocabulary x hidden) is a matmul of its own, which the prompt-processing figures of
``llama-bench`` leave out. This separates the two.

    python benchmarks/verify_rows_logits.py --rows 1,2,3,4,8 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.models.demo import DEFAULT_TARGET, demo_model_path

# Positions already in the cache: nearer a chat turn's context than the engine's own cost
# probes (``core.timing.COST_PROBE_CONTEXT``, 64).
CONTEXT = 256
FILLER = 15  # an ordinary token id


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: the demo target, assembled if missing)")
    parser.add_argument("--rows", default="1,2,3,4,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--context", type=int, default=CONTEXT, help=f"positions cached before each pass (default {CONTEXT})")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    model = LlamaCppModel(args.gguf or str(demo_model_path(DEFAULT_TARGET)), n_ctx=max(2048, args.context + max(rows_list)))
    model.forward(0, [FILLER] * args.context, 0, "none")

    def once(rows: int, mode: str) -> float:
        started = time.perf_counter()
        model.forward(0, [FILLER] * rows, args.context, mode)
        return time.perf_counter() - started

    base = None
    print("rows | all rows' logits | last row's | none | all / last")
    for rows in rows_list:
        # The three modes alternate within each repeat, so that the machine's drift touches them alike.
        times: dict[str, list[float]] = {"all": [], "last": [], "none": []}
        for _ in range(args.repeats):
            for mode in times:
                times[mode].append(once(rows, mode))
        all_, last, none = (statistics.median(times[mode]) for mode in ("all", "last", "none"))
        base = base or last
        print(f"{rows} | {all_ * 1e3:.1f} ms ({all_ / base:.2f}) | {last * 1e3:.1f} ms ({last / base:.2f}) | "
              f"{none * 1e3:.1f} ms ({none / base:.2f}) | {all_ / last:.2f}")
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

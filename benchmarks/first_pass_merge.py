"""What feeding a prompt's tail in the first verify pass saves on llama.cpp: the demo target's
time to its first logits after ``cached`` positions, for ``new`` new prompt tokens, fed as

- *split*: a prefill of the first ``new - 1`` tokens without logits, then the last token alone
  (what the engine did before: the first verify pass fed only the prompt's last token);
- *merged*: all ``new`` tokens in one pass with the last row's logits (what it does now, and
  what llama-server and ``transformers`` do).

The two alternate within each repeat, so the machine's drift touches them alike; medians.

    python benchmarks/first_pass_merge.py --cases 26:4,26:8,26:16,26:32,169:27,0:160 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.models.demo import DEFAULT_TARGET, demo_model_path

# Ordinary, varied token ids (no special tokens): the pass's cost does not depend on which.
TOKENS = [(i * 37) % 5000 + 100 for i in range(4096)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: the demo target, assembled if missing)")
    parser.add_argument("--cases", default="26:4,26:8,26:12,26:16,26:24,26:32,26:64,169:27,0:160",
                        help="cached:new pairs; 26 is the demo chat template's shared system prefix")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    cases = [tuple(int(x) for x in case.split(":")) for case in args.cases.split(",")]
    if any(new < 1 or cached < 0 or cached + new > len(TOKENS) for cached, new in cases):
        parser.error(f"each case needs new >= 1, cached >= 0 and cached + new <= {len(TOKENS)}")
    model = LlamaCppModel(args.gguf or str(demo_model_path(DEFAULT_TARGET)), n_ctx=max(c + n for c, n in cases) + 1)

    def split(cached: int, new: int) -> None:
        if new > 1:
            model.forward(0, TOKENS[cached : cached + new - 1], cached, "none")
        model.forward(0, TOKENS[cached + new - 1 : cached + new], cached + new - 1, "last")

    def merged(cached: int, new: int) -> None:
        model.forward(0, TOKENS[cached : cached + new], cached, "last")

    rows = []
    print("cached | new | split | merged | saved")
    for cached, new in cases:
        model.clear(0)
        if cached:
            model.forward(0, TOKENS[:cached], 0, "none")
        times: dict[str, list[float]] = {"split": [], "merged": []}
        for _ in range(args.repeats):
            for name, run in (("split", split), ("merged", merged)):
                model.truncate(0, cached)
                started = time.perf_counter()
                run(cached, new)
                times[name].append(time.perf_counter() - started)
        a, b = statistics.median(times["split"]), statistics.median(times["merged"])
        rows.append({"cached": cached, "new": new, "split_seconds": a, "merged_seconds": b, "repeats": args.repeats})
        print(f"{cached} | {new} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {(a - b) * 1e3:.1f} ms ({(a - b) / a:.0%})")
    model.close()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cases": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

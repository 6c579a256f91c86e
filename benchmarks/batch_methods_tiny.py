"""Each batched method against the same method one request at a time, on the suite's tiny
torch model (issue 45: "8 clients on torch with the tiny models: every method's aggregate
tokens/s above the same method one at a time").

Eight prompts (the words below, some repeating themselves, so lookups and suffix trees find
matches), greedy, ``--tokens`` each: one at a time through ``SpecDecoder.generate`` (the
single-request engine), then all at once through ``generate_batch`` (the batch engine, suffix
rows drafting token trees on torch). Medians over ``--repeats``; outputs are checked equal.
For medusa and eagle it trains the suite's heads on its repeating text first (as the tests'
fixtures do, about a minute each); layerskip skips the tiny model's second layer.

    python benchmarks/batch_methods_tiny.py --methods none,ngram,suffix,auto,medusa,eagle,layerskip --tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_models  # noqa: E402 - the suite's tiny model builder, found through the line above

from specdecode import SamplingParams, SpecDecoder  # noqa: E402

PROMPTS = ["def add(a, b):\n    return a + b\n\n" * 3, "1, 2, 3, 1, 2, 3, 1, 2, 3,", "the cat and the cat and the",
           "def quicksort(arr):", "import numpy as np\nimport numpy as np\n", "once upon a time once upon",
           "for i in range(10): print(i)\nfor i in range(10):", "The quick brown fox"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="none,ngram,suffix,auto")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    folder = tiny_models.make_tiny_hf_model(work / "tiny", arch="qwen2", seed=0)
    methods = args.methods.split(",")
    dec = SpecDecoder.from_pretrained(str(folder), method="none", dtype="fp32", device="cpu", show_progress=False,
                                      skip_layers=(1,) if "layerskip" in methods else (), draft_confidence=0.0)
    kinds = [kind for kind in ("medusa", "eagle") if kind in methods]
    if kinds:
        import torch
        from helpers import pattern_features, train_pattern_heads

        from specdecode.models.heads import load_heads

        (work / "pattern").mkdir()
        features = pattern_features(folder, work / "pattern")
        for kind in kinds:
            train_pattern_heads(kind, features, work / kind, epochs=12)
            dec.attach_heads(load_heads(work / kind, torch.float32, torch.device("cpu")))
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    print(f"# tiny qwen2 (fp32, CPU), {len(PROMPTS)} prompts x {args.tokens} tokens, greedy, median of {args.repeats}")
    print(f"{'method':8} {'alone tok/s':>12} {'batched tok/s':>14} {'ratio':>6} {'tau alone':>10} {'tau batched':>12}")
    for method in methods:
        alone_rates, batch_rates = [], []
        for _ in range(args.repeats):
            dec.forget_prefix()
            started = time.perf_counter()
            alone = [dec.generate(p, params, method=method, k=4, suffix_group=None) for p in PROMPTS]
            alone_rates.append(sum(len(r.token_ids) for r in alone) / (time.perf_counter() - started))
            engine = dec.batch_engine(max_batch=len(PROMPTS), kv_cache_tokens=8192, cost_aware=False)
            started = time.perf_counter()
            batched = dec.generate_batch(PROMPTS, params, method=method, k=4, engine=engine, suffix_group=None)
            batch_rates.append(sum(len(r.token_ids) for r in batched) / (time.perf_counter() - started))
            assert [r.token_ids for r in batched] == [r.token_ids for r in alone], f"{method}: outputs differ"

        def tau(results: list) -> float:
            steps = sum(r.stats.verify_steps for r in results)
            return sum(len(r.token_ids) for r in results) / steps if steps else 0.0

        a, b = statistics.median(alone_rates), statistics.median(batch_rates)
        print(f"{method:8} {a:12.1f} {b:14.1f} {b / a:6.2f} {tau(alone):10.2f} {tau(batched):12.2f}")


if __name__ == "__main__":
    main()

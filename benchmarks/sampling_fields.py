"""What logprobs and penalties cost under speculation, on the demo pair, side by side in one run.

- tokens/s of a method with and without ``logprobs`` (top 5), runs interleaved, medians over repeats
  (issue 31's target: within 3%);
- acceptance of a method with ``frequency_penalty`` against without, on the first prompt of each
  category of the bench's default set (target: >= 90% of it kept; the draft sees the same
  processing).

    python benchmarks/sampling_fields.py --backend llama.cpp --method auto --repeats 3 --tokens 96
"""

from __future__ import annotations

import argparse
import json
import statistics

from specdecode import SamplingParams, SpecDecoder
from specdecode.prompt_sets import DEFAULT_SOURCE, load_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="llama.cpp")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--frequency-penalty", type=float, default=0.5)
    parser.add_argument("--categories", type=int, default=7, help="first prompts of this many categories")
    args = parser.parse_args()
    dec = SpecDecoder.from_pretrained(backend=args.backend, method=args.method, show_progress=False)
    prompts, seen = [], set()
    for prompt in load_prompts([DEFAULT_SOURCE]):
        if prompt.category not in seen and len(seen) < args.categories:
            seen.add(prompt.category)
            prompts.append((prompt.category, [{"role": "user", "content": prompt.turns[0]}]))
    settings = {
        "plain": {},
        "logprobs": {"logprobs": 5},
        "penalty": {"frequency_penalty": args.frequency_penalty},
    }
    dec.generate(prompts[0][1], SamplingParams(max_new_tokens=8), chat=True)  # warm (and auto's cost probes)
    speed: dict[str, list[float]] = {name: [] for name in settings}
    accepted = dict.fromkeys(settings, 0)
    proposed = dict.fromkeys(settings, 0)
    for repeat in range(args.repeats):
        for _, messages in prompts:
            for name, extra in settings.items():
                dec.forget_prefix()  # every run prefills its whole prompt
                # and drafts from its own text only: auto's suffix source would otherwise find the
                # run before's answer (the same text, for plain and logprobs) and accept it whole.
                dec.suffix_cache.clear()
                result = dec.generate(messages, SamplingParams(max_new_tokens=args.tokens, **extra), chat=True)
                speed[name].append(result.stats.new_tokens / result.stats.total_seconds)
                if repeat == 0:
                    accepted[name] += result.stats.draft_tokens_accepted
                    proposed[name] += result.stats.draft_tokens_proposed
    rows = {}
    for name in settings:
        rate = accepted[name] / proposed[name] if proposed[name] else None
        rows[name] = {"median_tokens_per_second": statistics.median(speed[name]), "acceptance_rate": rate,
                      "accepted": accepted[name], "proposed": proposed[name]}
    base = rows["plain"]
    for name, row in rows.items():
        # Paired: each run against the plain run of the same prompt and repeat, just before it.
        row["speed_vs_plain"] = statistics.median(a / b for a, b in zip(speed[name], speed["plain"], strict=True))
        if row["acceptance_rate"] is not None and base["acceptance_rate"]:
            row["acceptance_vs_plain"] = row["acceptance_rate"] / base["acceptance_rate"]
    print(json.dumps({"backend": args.backend, "method": args.method, "tokens": args.tokens,
                      "repeats": args.repeats, "categories": sorted(seen), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

"""Per-token cost of a grammar: constrained plain decoding against unconstrained plain decoding
(and `auto` under the grammar), on the demo pair, side by side in one run, medians over repeats.

    python benchmarks/structured_overhead.py --backend llama.cpp --repeats 3 --tokens 96
"""

from __future__ import annotations

import argparse
import json
import statistics

from specdecode import SamplingParams, SpecDecoder
from specdecode.config import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "language": {"enum": ["python", "rust", "go"]},
        "lines": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "language", "lines", "tags"], "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Describe a quicksort implementation as a JSON object with the fields name, "
                                      "language, lines and tags."}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="llama.cpp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    dec = SpecDecoder.from_pretrained(backend=args.backend, method="auto", show_progress=False)
    spec = StructuredOutput(json_schema=SCHEMA)
    runs = {"none": ("none", None), "none+schema": ("none", spec), "auto+schema": ("auto", spec)}
    dec.generate(PROMPT, SamplingParams(max_new_tokens=8, structured=spec), chat=True, method="none")  # compile, warm
    per_token: dict[str, list[float]] = {name: [] for name in runs}
    mask: dict[str, list[float]] = {name: [] for name in runs}
    texts = {}
    for _ in range(args.repeats):
        for name, (method, structured) in runs.items():
            dec.forget_prefix()
            params = SamplingParams(max_new_tokens=args.tokens, structured=structured, ignore_eos=structured is None)
            result = dec.generate(PROMPT, params, chat=True, method=method)
            decode = result.stats.total_seconds - result.stats.prefill_seconds
            per_token[name].append(decode / result.stats.new_tokens)
            mask[name].append(result.stats.mask_seconds / result.stats.new_tokens)
            texts[name] = result.text
    base = statistics.median(per_token["none"])
    for name in runs:
        med = statistics.median(per_token[name])
        print(f"{name:12s} decode {med * 1e3:7.1f} ms/token  ({med / base:.3f}x plain)  "
              f"grammar {statistics.median(mask[name]) * 1e3:.2f} ms/token")
    for name in ("none+schema", "auto+schema"):
        try:
            json.loads(texts[name])
            print(f"{name}: valid JSON")
        except json.JSONDecodeError:
            print(f"{name}: not complete JSON (cut at {args.tokens} tokens?): {texts[name][:80]!r}")


if __name__ == "__main__":
    main()

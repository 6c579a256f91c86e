"""OpenAI's ``n`` against n separate requests, through a running server: issue 31's target
(``n = 4``: >= 2x the tokens/s of 4 requests one at a time). ``specdecode bench`` drives the
library, not a server, so this measures what it cannot.

Loopback only, a fixed number of requests, stops by itself:

    specdecode serve --backend llama.cpp --method none --port 8000 &
    python benchmarks/parallel_sampling.py --url http://127.0.0.1:8000 --n 4 --repeats 3 --out results/n4.json

For each prompt and repeat, side by side: one request with ``n`` choices (seed s), then ``n``
requests with n = 1 and seeds s .. s + n - 1, one after another (the same samples: choice i is
seeded with seed + i). Tokens/s counts every choice's completion tokens over the wall time of
the request(s); the ratio is paired per prompt and repeat, and its median reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a function that returns the n-th Fibonacci number iteratively.",
    "Write a haiku about the sea.",
]


def timed(client: httpx.Client, url: str, body: dict) -> tuple[float, int, list[str]]:
    """(seconds, completion tokens, choice texts) of one chat completion."""
    start = time.perf_counter()
    response = client.post(url + "/v1/chat/completions", json=body)
    seconds = time.perf_counter() - start
    response.raise_for_status()
    reply = response.json()
    return seconds, reply["usage"]["completion_tokens"], [c["message"]["content"] for c in reply["choices"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="the served model name (default: the server's first)")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--method", default=None, help="a method the server loaded (default: the server's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with httpx.Client(timeout=600) as client:
        model = args.model or client.get(args.url + "/v1/models").json()["data"][0]["id"]
        base = {"model": model, "max_tokens": args.tokens, "temperature": args.temperature}
        if args.method:
            base["method"] = args.method
        timed(client, args.url, base | {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})  # warm
        rows = []
        for repeat in range(args.repeats):
            for index, prompt in enumerate(PROMPTS):
                seed = 1000 * repeat + index
                body = base | {"messages": [{"role": "user", "content": prompt}]}
                together, tokens, texts = timed(client, args.url, body | {"n": args.n, "seed": seed})
                apart_seconds, apart_tokens, apart_texts = 0.0, 0, []
                for choice in range(args.n):
                    seconds, count, (text,) = timed(client, args.url, body | {"seed": seed + choice})
                    apart_seconds += seconds
                    apart_tokens += count
                    apart_texts.append(text)
                rows.append({"prompt": index, "repeat": repeat, "n_seconds": together, "n_tokens": tokens,
                             "apart_seconds": apart_seconds, "apart_tokens": apart_tokens,
                             "same_texts": texts == apart_texts,
                             "speedup": (tokens / together) / (apart_tokens / apart_seconds)})
                print(json.dumps(rows[-1]), flush=True)
    summary = {
        "url": args.url, "model": model, "n": args.n, "tokens": args.tokens, "temperature": args.temperature,
        "method": args.method, "repeats": args.repeats,
        "median_n_tokens_per_second": statistics.median(r["n_tokens"] / r["n_seconds"] for r in rows),
        "median_apart_tokens_per_second": statistics.median(r["apart_tokens"] / r["apart_seconds"] for r in rows),
        "median_speedup": statistics.median(r["speedup"] for r in rows),
        "same_texts": sum(r["same_texts"] for r in rows), "rows": rows,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()

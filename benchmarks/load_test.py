"""Drive a running ``specdecode serve`` with concurrent streaming clients; report throughput and latency.

Loopback only, a fixed number of requests per level, stops by itself:

    specdecode serve --port 8000 &            # the demo pair, method draft
    python benchmarks/load_test.py --url http://127.0.0.1:8000 --concurrency 1,4 \
        --methods none,draft --requests 8 --max-tokens 64 --out results/load.json

For every (method, concurrency) it sends ``--requests`` chat requests (at least as many as the
concurrency) (greedy, the request's
``method`` extension field choosing plain or speculative decoding), ``--concurrency`` at a
time, each streaming. It reports aggregate tokens/s (completion tokens of all requests over
the level's wall time; with ``--repeats`` the median over repeats, the methods taking turns
within each repeat), time to first token and inter-token latency percentiles (p50, p90,
p99; inter-token gaps are measured between streamed chunks and divided by the tokens a chunk
carried, since one speculative step streams several tokens at once). Every request either
completes or is counted as an error: nothing is silently lost.

``--fairness`` measures instead how long a short request waits behind a full batch of long
generations (docs/design.md#fair-scheduling; issue 32's bound: its first token within two of
the batch's longest steps plus its own prefill):

    specdecode serve --backend llama.cpp --method none --port 8000 &
    python benchmarks/load_test.py --fairness --long-requests 10 --long-tokens 256 \
        --ban-tokens 151643,151645 --out results/fair.json

It starts ``--long-requests`` streamed generations of ``--long-tokens`` (the ban keeps them
from ending early: the demo models' end tokens), waits until ``--seats`` of them have streamed
``--warm-chunks`` chunks, then sends ``--short-requests`` short ones, one at a time. Per short
request: the client's time to first token, the engine's (``first_token_seconds``, from its
admission to the queue) and its prefill, and the step time while it waited (per long stream,
the longest gap between its chunks overlapping the wait; the median over streams, so a
preempted stream's pause does not count as a step). Also the long generations' throughput
(their tokens over the time until the last ended), to compare servers started with and without
``--time-slice 0 --prefill-chunk 0``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "Write a function that returns the n-th Fibonacci number iteratively.",
    "List three differences between TCP and UDP.",
    "Write a quicksort in Python.",
    "What does the `yield` keyword do in Python?",
    "Write a function that merges two sorted lists.",
    "Summarise the rules of tic-tac-toe in one paragraph.",
]
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(slots=True)
class RequestResult:
    ok: bool
    tokens: int = 0
    seconds: float = 0.0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)  # seconds per token between chunks
    error: str = ""


async def one_request(client, url: str, model: str, method: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "method": method}
    started = time.perf_counter()
    last, ttft, gaps, tokens = started, None, [], 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
            if response.status_code != 200:
                return RequestResult(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    return RequestResult(False, error=chunk["error"]["message"])
                usage = chunk.get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
                if not chunk["choices"][0]["delta"].get("content"):
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - started
                else:
                    gaps.append(now - last)
                last = now
    except Exception as err:  # reported per request; the run goes on
        return RequestResult(False, error=f"{type(err).__name__}: {err}")
    # Spread each gap over the tokens it delivered on average (a step streams accepted + 1).
    chunks = len(gaps) + 1
    per_token = [g * chunks / max(tokens, 1) for g in gaps]
    return RequestResult(True, tokens, time.perf_counter() - started, ttft, per_token)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99)}


async def run_level(url: str, model: str, method: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    import httpx

    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def limited(i: int) -> RequestResult:
            async with semaphore:
                return await one_request(client, url, model, method, PROMPTS[i % len(PROMPTS)], max_tokens)

        started = time.perf_counter()
        results = await asyncio.gather(*(limited(i) for i in range(requests)))
        wall = time.perf_counter() - started
    done = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in done)
    return {
        "method": method, "concurrency": concurrency, "requests": requests, "completed": len(done),
        "errors": [r.error for r in results if not r.ok], "wall_seconds": wall, "completion_tokens": tokens,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "ttft_seconds": percentiles([r.ttft for r in done if r.ttft is not None]),
        "inter_token_seconds": percentiles([g for r in done for g in r.gaps]),
        "_ttfts": [r.ttft for r in done if r.ttft is not None], "_gaps": [g for r in done for g in r.gaps],
    }


@dataclass(slots=True)
class Stream:
    """One streamed completion of the fairness run: when it was sent, when each chunk came."""

    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    metrics: dict = field(default_factory=dict)
    error: str = ""


async def stream_one(client, url: str, model: str, prompt: str, max_tokens: int, ban: list[int],
                     result: Stream | None = None) -> Stream:
    """Stream one chat completion into ``result`` (filled as chunks arrive) and return it."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "method": "none"}
    if ban:
        body["logit_bias"] = {str(t): -100 for t in ban}
    result = result or Stream()
    result.sent = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.tokens, result.metrics = chunk["usage"]["completion_tokens"], chunk.get("specdecode", {})
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    result.chunks.append(time.perf_counter())
    except Exception as err:  # reported; the run goes on
        result.error = f"{type(err).__name__}: {err}"
    return result


LONG_PROMPT = "Count from 1 to 2000, one number per line, with nothing else."
SHORT_PROMPT = "Say hi."


async def run_fairness(args: argparse.Namespace, model: str) -> dict:
    import statistics

    import httpx

    ban = [int(t) for t in args.ban_tokens.split(",") if t]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=args.long_requests + 4)) as client:
        started = time.perf_counter()
        longs = [Stream() for _ in range(args.long_requests)]
        tasks = [asyncio.create_task(stream_one(client, args.url, model, f"{LONG_PROMPT} (list {i})", args.long_tokens,
                                                ban, longs[i])) for i in range(args.long_requests)]
        # The batch is full of long generations that have decoded a while: the short requests go.
        while sum(len(s.chunks) >= args.warm_chunks for s in longs) < min(args.seats, args.long_requests):
            if all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.1)
        shorts = []
        for _ in range(args.short_requests):
            shorts.append(await stream_one(client, args.url, model, SHORT_PROMPT, args.short_tokens, []))
            await asyncio.sleep(1.0)
        await asyncio.gather(*tasks)
        wall = max((s.chunks[-1] for s in longs if s.chunks), default=started) - started
    rows = []
    for short in shorts:
        if short.error or not short.chunks:
            rows.append({"error": short.error or "no tokens"})
            continue
        first = short.chunks[0]
        step_gaps = []
        for stream in longs:
            times = [stream.sent] + stream.chunks
            overlapping = [b - a for a, b in zip(times, times[1:]) if b > short.sent and a < first]
            if overlapping:
                step_gaps.append(max(overlapping))
        step = statistics.median(step_gaps) if step_gaps else None
        engine_ttft, prefill = short.metrics.get("first_token_seconds"), short.metrics.get("prefill_seconds")
        rows.append({"client_ttft_seconds": first - short.sent, "engine_ttft_seconds": engine_ttft,
                     "prefill_seconds": prefill, "step_seconds": step,
                     "bound_seconds": None if step is None or prefill is None else 2 * step + prefill})
    long_tokens = sum(s.tokens for s in longs)
    return {"long_requests": args.long_requests, "long_tokens": args.long_tokens, "wall_seconds": wall,
            "long_tokens_per_second": long_tokens / wall if wall > 0 else 0.0, "long_completion_tokens": long_tokens,
            "errors": [s.error for s in longs + shorts if s.error], "shorts": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--methods", default="none,draft")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=8,
                        help="requests per (method, concurrency); a level sends at least its concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="runs of every (method, concurrency), methods taking turns")
    parser.add_argument("--out", help="write the table as JSON here")
    fair = parser.add_argument_group("--fairness: a short request behind a full batch of long ones")
    fair.add_argument("--fairness", action="store_true")
    fair.add_argument("--long-requests", type=int, default=10)
    fair.add_argument("--long-tokens", type=int, default=256)
    fair.add_argument("--short-requests", type=int, default=3)
    fair.add_argument("--short-tokens", type=int, default=4)
    fair.add_argument("--seats", type=int, default=8, help="the server's --max-batch")
    fair.add_argument("--warm-chunks", type=int, default=24,
                      help="chunks the running long streams have streamed before the short requests go")
    fair.add_argument("--ban-tokens", default="", help="token ids the long requests may not sample (their end tokens)")
    args = parser.parse_args()
    if urlparse(args.url).hostname not in LOOPBACK_HOSTS:
        print("load_test: only loopback servers are driven (127.0.0.1, localhost, ::1)", file=sys.stderr)
        return 2
    import httpx

    model = args.model or httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    if args.fairness:
        result = asyncio.run(run_fairness(args, model))
        for row in result["shorts"]:
            if "error" in row:
                print(f"short request failed: {row['error']}")
                continue
            print(f"short: client TTFT {fmt(row['client_ttft_seconds'], 's')}, engine {fmt(row['engine_ttft_seconds'], 's')} "
                  f"(prefill {fmt(row['prefill_seconds'], 's')}; bound 2 x step {fmt(row['step_seconds'], 's')} + prefill "
                  f"= {fmt(row['bound_seconds'], 's')})", flush=True)
        print(f"long: {result['long_completion_tokens']} tokens in {result['wall_seconds']:.1f} s, "
              f"{result['long_tokens_per_second']:.2f} tok/s", flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"url": args.url, "model": model, **result}, indent=2) + "\n")
        return 0 if not result["errors"] else 1
    methods = [m for m in args.methods.split(",") if m]
    rows, summary = [], []
    for level in [int(c) for c in args.concurrency.split(",") if c]:
        runs: dict[str, list[dict]] = {method: [] for method in methods}
        # Methods take turns within each repeat, so drift in the machine's speed hits them alike.
        for repeat in range(args.repeats):
            for method in methods:
                row = asyncio.run(run_level(args.url, model, method, level, max(args.requests, level), args.max_tokens))
                row["repeat"] = repeat
                rows.append(row)
                runs[method].append(row)
        level_summary = [summarise(runs[method]) for method in methods]
        summary += level_summary
        for method, line in zip(methods, level_summary):
            ttft, itl = line["ttft_seconds"]["p50"], line["inter_token_seconds"]["p50"]
            ratio = line["tokens_per_second"] / level_summary[0]["tokens_per_second"]
            print(f"{method:>8} c={level:<3} {line['completed']}/{line['requests']} ok  {line['tokens_per_second']:6.2f} tok/s "
                  f"(median of {args.repeats}; {ratio:.2f}x {methods[0]})  TTFT p50 {fmt(ttft, 's')}  ITL p50 {fmt(itl, 'ms')}",
                  flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"url": args.url, "model": model, "max_tokens": args.max_tokens,
                                              "repeats": args.repeats, "summary": summary, "rows": rows}, indent=2) + "\n")
    return 0 if all(not row["errors"] for row in rows) else 1


def summarise(runs: list[dict]) -> dict:
    """One (method, concurrency): the median tokens/s over repeats, latencies pooled over them."""
    import statistics

    return {
        "method": runs[0]["method"], "concurrency": runs[0]["concurrency"], "repeats": len(runs),
        "requests": sum(r["requests"] for r in runs), "completed": sum(r["completed"] for r in runs),
        "errors": [e for r in runs for e in r["errors"]],
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
        "tokens_per_second_runs": [r["tokens_per_second"] for r in runs],
        "ttft_seconds": percentiles([t for r in runs for t in r["_ttfts"]]),
        "inter_token_seconds": percentiles([g for r in runs for g in r["_gaps"]]),
    }


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if unit == "ms" else f"{value:.2f} s"


if __name__ == "__main__":
    sys.exit(main())

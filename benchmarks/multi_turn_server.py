"""Multi-turn chats and a shared system prompt against a running OpenAI-compatible server (ours or
llama-server): time to first token per turn and whole-session time, the prefix cache's workload.

Loopback only, a fixed number of requests, stops by itself:

    specdecode serve --backend llama.cpp --method none --port 8000 &
    python benchmarks/multi_turn_server.py --url http://127.0.0.1:8000 --chats 4 --out results/chats.json
    python benchmarks/multi_turn_server.py --url http://127.0.0.1:8000 --agentic --chats 4 --clients 4 \
        --turn-tokens 192 --out results/agents-4.json
    llama-server -m TARGET.gguf -t 2 -c 4096 -np 1 --port 8001 &
    python benchmarks/multi_turn_server.py --url http://127.0.0.1:8001 --chats 4 --out results/chats-llama-server.json

``chats`` mode: each chat is two turns, streamed, one client, one chat after another (turn 1:
``--first-tokens``, turn 2: ``--second-tokens``, greedy); turn 2's messages hold turn 1 and its
answer. With ``--agentic``, the conversations are instead the agentic set's code-editing
sessions (``specdecode.prompt_sets``, four turns each, every turn after the first asking to change
the previous answer and reply with the whole code; ``--turn-tokens`` per turn): the workload
where speculation pays, as agent loops' is. ``system`` mode (``--system-requests N``): N requests sharing a long system prompt
(``--system-words`` words), ``--concurrency`` at a time, each with its own question. Reports each
turn's time to first token, the chats' wall times and, where the server says
(``usage.prompt_tokens_details.cached_tokens``, in the final chunk with
``stream_options.include_usage``), the cached prompt tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

# A new connection per request: llama-server closes a connection after a streamed response while
# httpx may already be sending the next request on it ("Server disconnected without sending a
# response"), which cut every earlier run against it short. Loopback connects cost ~0.1 ms.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)

FIRST_TURNS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a function that returns the n-th Fibonacci number iteratively.",
    "Write a quicksort in Python.",
    "Write a function that merges two sorted lists.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a function that counts the words in a text file.",
]
SECOND_TURN = "Now add type hints and a docstring, and show the whole function again."
QUESTIONS = ["What is a list comprehension?", "Explain recursion briefly.", "What does `yield` do?",
             "What is a dictionary?", "How do I read a file?", "What is a lambda?", "What is a set?",
             "What is a tuple?"]


async def stream_chat(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                      extra: dict) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    started = time.perf_counter()
    first = None
    text, usage = [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    if first is None:
                        first = time.perf_counter() - started
                    text.append(delta)
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft": first, "seconds": time.perf_counter() - started, "text": "".join(text),
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "cached_tokens": details.get("cached_tokens"),
            "completion_tokens": (usage or {}).get("completion_tokens")}


async def chats(url: str, model: str, count: int, first_tokens: int, second_tokens: int, extra: dict) -> dict:
    results = []
    async with httpx.AsyncClient(limits=NO_KEEPALIVE) as client:
        for prompt in (FIRST_TURNS * count)[:count]:
            started = time.perf_counter()
            messages = [{"role": "user", "content": prompt}]
            one = await stream_chat(client, url, model, messages, first_tokens, extra)
            messages += [{"role": "assistant", "content": one["text"]}, {"role": "user", "content": SECOND_TURN}]
            two = await stream_chat(client, url, model, messages, second_tokens, extra)
            results.append({"turns": [one, two], "session_seconds": time.perf_counter() - started})
    return {
        "chats": results,
        "turn1_ttft_mean": statistics.mean(r["turns"][0]["ttft"] for r in results),
        "turn2_ttft_mean": statistics.mean(r["turns"][1]["ttft"] for r in results),
        "session_seconds_mean": statistics.mean(r["session_seconds"] for r in results),
    }


async def agentic(url: str, model: str, count: int, turn_tokens: int, extra: dict, clients: int = 1) -> dict:
    """The first ``count`` agentic sessions, turn after turn, each turn's messages holding the
    earlier turns and answers; ``clients`` sessions at once, each client its own session (the
    agents of issue 45). Reported in the shape of ``chats`` (``multi_turn_tokens.py`` reads it),
    with the aggregate tokens per second over the wall time (the server's usage counts)."""
    from specdecode.prompt_sets import load_agentic

    gate = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(limits=NO_KEEPALIVE) as client:
        async def run(session) -> dict:
            async with gate:
                started = time.perf_counter()
                messages: list[dict] = []
                turns = []
                for prompt in session.turns:
                    messages.append({"role": "user", "content": prompt})
                    turn = await stream_chat(client, url, model, messages, turn_tokens, extra)
                    messages.append({"role": "assistant", "content": turn["text"]})
                    turns.append(turn)
                return {"id": session.prompt_id, "turns": turns, "session_seconds": time.perf_counter() - started}

        wall_started = time.perf_counter()
        results = list(await asyncio.gather(*(run(session) for session in load_agentic()[:count])))
        wall = time.perf_counter() - wall_started
    later = [t["ttft"] for r in results for t in r["turns"][1:]]
    tokens = [t["completion_tokens"] for r in results for t in r["turns"]]
    return {
        "chats": results,
        "clients": clients,
        "turn1_ttft_mean": statistics.mean(r["turns"][0]["ttft"] for r in results),
        "turn2_ttft_mean": statistics.mean(later),
        "session_seconds_mean": statistics.mean(r["session_seconds"] for r in results),
        "wall_seconds": wall,
        "aggregate_tokens_per_second": sum(tokens) / wall if all(t is not None for t in tokens) else None,
    }


async def shared_system(url: str, model: str, requests: int, concurrency: int, words: int, max_tokens: int,
                        extra: dict) -> dict:
    system = " ".join(f"rule{i % 50}: answer briefly and precisely." for i in range(words // 5))
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=NO_KEEPALIVE) as client:
        async def one(i: int) -> dict:
            async with gate:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
                try:
                    return await stream_chat(client, url, model, messages, max_tokens, extra)
                except httpx.HTTPError as err:  # counted, not fatal: the other requests' figures stand
                    return {"ttft": None, "error": f"{type(err).__name__}: {err}", "cached_tokens": None}

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(requests)))
    answered = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"requests": results, "ttft_mean": statistics.mean(answered) if answered else None,
            "errors": sum(r["ttft"] is None for r in results), "wall_seconds": time.perf_counter() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--first-tokens", type=int, default=128)
    parser.add_argument("--second-tokens", type=int, default=64)
    parser.add_argument("--agentic", action="store_true",
                        help="run --chats of the agentic set's four-turn code-editing sessions instead of the two-turn chats")
    parser.add_argument("--turn-tokens", type=int, default=256, help="max tokens per turn with --agentic")
    parser.add_argument("--clients", type=int, default=1,
                        help="with --agentic: sessions at once, each client its own session (aggregate tokens/s)")
    parser.add_argument("--system-requests", type=int, default=0, help="also run the shared-system-prompt mode")
    parser.add_argument("--system-words", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--extra", default="{}", help="JSON merged into every request body, e.g. '{\"method\": \"none\"}'")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    model = args.model or httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    extra = json.loads(args.extra)
    report: dict = {"url": args.url, "model": model, "extra": extra}
    if args.chats:
        if args.agentic:
            report["chats"] = asyncio.run(agentic(args.url, model, args.chats, args.turn_tokens, extra, args.clients))
        else:
            report["chats"] = asyncio.run(chats(args.url, model, args.chats, args.first_tokens, args.second_tokens,
                                                extra))
        c = report["chats"]
        per_chat = ", ".join(f"{r['turns'][1]['ttft']:.2f}" for r in c["chats"])
        print(f"chats: turn-1 TTFT {c['turn1_ttft_mean']:.2f} s, later turns' TTFT {c['turn2_ttft_mean']:.2f} s "
              f"(per chat: {per_chat}), "
              f"session {c['session_seconds_mean']:.2f} s; "
              + (f"{c['clients']} clients: {c['aggregate_tokens_per_second']:.2f} tok/s aggregate over "
                 f"{c['wall_seconds']:.1f} s; " if c.get("aggregate_tokens_per_second") else "")
              + "later turns' cached tokens "
              f"{[[t['cached_tokens'] for t in r['turns'][1:]] for r in c['chats']]}")
    if args.system_requests:
        report["system"] = asyncio.run(shared_system(args.url, model, args.system_requests, args.concurrency,
                                                     args.system_words, 32, extra))
        s = report["system"]
        mean = "-" if s["ttft_mean"] is None else f"{s['ttft_mean']:.2f} s"
        print(f"shared system prompt: {args.system_requests} requests, {args.concurrency} at a time: mean TTFT "
              f"{mean}, wall {s['wall_seconds']:.1f} s, {s['errors']} failed; cached tokens "
              f"{[r['cached_tokens'] for r in s['requests']]}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

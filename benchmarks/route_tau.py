"""tau of the same greedy request through chat completions, the Responses API and Anthropic's
Messages API on a running server (issue 51: speculation stays on for every route).

    specdecode serve --method auto --port 8093 &
    python benchmarks/route_tau.py --url http://127.0.0.1:8093 --rounds 3

Each round sends the request through the three routes, in an order that rotates from round to
round (later requests draft from earlier answers' suffix trees, so order matters); prints each
route's tau per round, read from the response's ``specdecode`` metrics.
"""

from __future__ import annotations

import argparse
import itertools

import httpx

MESSAGE = ("Write a Python function that parses a CSV file of (name, age) rows and returns the average age. "
           "Then write the same for a TSV file.")
ROUTES = ("chat", "responses", "messages")


def send(base: str, model: str, route: str, tokens: int) -> float:
    if route == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": MESSAGE}], "max_tokens": tokens, "temperature": 0}
        path = "/v1/chat/completions"
    elif route == "responses":
        body = {"model": model, "input": MESSAGE, "max_output_tokens": tokens, "temperature": 0}
        path = "/v1/responses"
    else:
        body = {"model": model, "messages": [{"role": "user", "content": MESSAGE}], "max_tokens": tokens, "temperature": 0}
        path = "/v1/messages"
    reply = httpx.post(base + path, json=body, timeout=600)
    reply.raise_for_status()
    return float(reply.json()["specdecode"]["tau"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8093")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=160)
    args = parser.parse_args()
    model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    taus: dict[str, list[float]] = {route: [] for route in ROUTES}
    orders = itertools.cycle([ROUTES[i:] + ROUTES[:i] for i in range(len(ROUTES))])
    for _, order in zip(range(args.rounds), orders, strict=False):
        for route in order:
            taus[route].append(send(args.url, model, route, args.tokens))
    for route, values in taus.items():
        print(f"{route:10} tau per round: {', '.join(f'{v:.2f}' for v in values)}")


if __name__ == "__main__":
    main()

"""Structured outputs on a set of agent schemas: constrained plain decoding against `auto` under
the same schema, on the demo pair, greedy, side by side in one run. Each output is checked with
`jsonschema`; times are whole requests (prefill included) and decode only, summed over the set.
A label's `+nojf` decodes without drafting the grammar's forced tokens (jump-forward), so the
two can be compared in one run.

    python benchmarks/structured_set.py --backend llama.cpp --tokens 200 --out benchmarks/results/structured_set.json
    python benchmarks/structured_set.py --methods none+nojf,none,auto+nojf,auto
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jsonschema

from specdecode import SamplingParams, SpecDecoder
from specdecode.config import StructuredOutput

TICKET = ("Customer Dana Whitfield (dana.whitfield@example.com, account 88213) wrote on 2026-11-28: the export "
          "button in the Reports page of the web app crashes on Firefox 131 under Windows 11 every time a report "
          "has more than 500 rows. She needs it fixed before the quarterly review.")
LISTING = ("Listing: Acme ProBrew 12-Cup Programmable Coffee Maker, stainless steel, thermal carafe, auto shut-off. "
           "Price: 89.99 USD. In stock: yes. Ships in 2 days. Tags: kitchen, coffee, appliances.")
MEETING = ("Notes from the platform sync on 2026-12-01. Present: Priya, Marco, Lena, Tom. Decided: move the CI "
           "runners to the new cluster; freeze the public API until v2.0; Lena owns the migration guide. Next "
           "sync on 2026-12-08.")
CODE = ("def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n")

SET = [
    ("tool call", "You can call search(query), read_file(path) or run_tests(path). Call one to find where the "
     "function parse_config is defined in the repository.", {
         "type": "object", "properties": {
             "name": {"enum": ["search", "read_file", "run_tests"]},
             "arguments": {"type": "object", "properties": {"query": {"type": "string"}, "path": {"type": "string"}}}},
         "required": ["name", "arguments"], "additionalProperties": False}),
    ("record extraction", f"Extract the customer's details from this ticket as JSON.\n\n{TICKET}", {
        "type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string"}, "account": {"type": "integer"},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["name", "email", "account", "date"], "additionalProperties": False}),
    ("bug report form", f"Fill in the bug report for this ticket as JSON.\n\n{TICKET}", {
        "type": "object", "properties": {
            "severity": {"enum": ["low", "medium", "high", "critical"]},
            "component": {"enum": ["reports", "billing", "auth", "search", "export"]},
            "browser": {"enum": ["chrome", "firefox", "safari", "edge", "other"]},
            "os": {"enum": ["windows", "macos", "linux", "ios", "android"]},
            "reproducible": {"type": "boolean"}, "summary": {"type": "string", "maxLength": 120}},
        "required": ["severity", "component", "browser", "os", "reproducible", "summary"],
        "additionalProperties": False}),
    ("product extraction", f"Extract the product from this listing as JSON.\n\n{LISTING}", {
        "type": "object", "properties": {
            "name": {"type": "string"}, "price": {"type": "number"}, "currency": {"enum": ["USD", "EUR", "GBP"]},
            "in_stock": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 6}},
        "required": ["name", "price", "currency", "in_stock", "tags"], "additionalProperties": False}),
    ("meeting summary (nested lists)", f"Summarize these notes as JSON.\n\n{MEETING}", {
        "type": "object", "properties": {
            "date": {"type": "string"}, "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
            "decisions": {"type": "array", "maxItems": 5, "items": {"type": "object", "properties": {
                "what": {"type": "string"}, "owner": {"type": "string"}}, "required": ["what"],
                "additionalProperties": False}},
            "next_meeting": {"type": "string"}},
        "required": ["date", "attendees", "decisions", "next_meeting"], "additionalProperties": False}),
    ("code review", f"Review this function and answer as JSON with the line of the problem.\n\n{CODE}", {
        "type": "object", "properties": {
            "line": {"type": "integer", "minimum": 1, "maximum": 5}, "problem": {"type": "string", "maxLength": 160},
            "fix": {"type": "string", "maxLength": 200}},
        "required": ["line", "problem", "fix"], "additionalProperties": False}),
    ("todo list", "Plan the steps to add a --verbose flag to a Python command-line tool, as a JSON todo list.", {
        "type": "object", "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 6, "items": {
            "type": "object", "properties": {
                "title": {"type": "string", "maxLength": 80}, "done": {"type": "boolean"},
                "priority": {"enum": ["low", "medium", "high"]}},
            "required": ["title", "done", "priority"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}),
    ("API request", "Write the HTTP request, as JSON, that creates a user named Ada with the email ada@example.com "
     "through a REST API at /api/v1/users with a bearer token TOKEN123.", {
         "type": "object", "properties": {
             "method": {"enum": ["GET", "POST", "PUT", "PATCH", "DELETE"]}, "path": {"type": "string"},
             "headers": {"type": "object", "additionalProperties": {"type": "string"}},
             "body": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                      "required": ["name", "email"], "additionalProperties": False}},
         "required": ["method", "path", "headers", "body"], "additionalProperties": False}),
]


def run(dec: SpecDecoder, label: str, prompt: str, schema: dict, tokens: int) -> dict:
    method, _, flag = label.partition("+")
    if flag not in ("", "nojf"):
        raise SystemExit(f"unknown label flag +{flag} (only +nojf)")
    dec.forget_prefix()  # each request prefills its whole prompt: methods compared on equal terms
    # ... and suffix decoding drafts from no earlier response: the same schema's answer from the
    # method run just before would be copied whole.
    dec.suffix_cache.clear()
    dec.grammars.jump_forward = flag != "nojf"
    params = SamplingParams(max_new_tokens=tokens, structured=StructuredOutput(json_schema=schema))
    started = time.perf_counter()
    result = dec.generate([{"role": "user", "content": prompt}], params, chat=True, method=method)
    seconds = time.perf_counter() - started
    dec.grammars.jump_forward = True
    try:
        jsonschema.validate(json.loads(result.text), schema)
        valid = True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        valid = False
    stats = result.stats
    return {"seconds": seconds, "decode_seconds": stats.total_seconds - stats.prefill_seconds,
            "tokens": stats.new_tokens, "valid": valid, "stop": stats.stop_reason, "tau": stats.tau,
            "grammar_seconds": stats.mask_seconds, "forced_proposed": stats.forced_tokens_proposed,
            "forced_accepted": stats.forced_tokens_accepted, "steps": stats.verify_steps,
            "text": result.text, "token_ids": result.token_ids}


def oracle_ceiling(dec: SpecDecoder, rows: list[dict], methods: list[str]) -> None:
    """Per schema and summed: plain / hindsight-best schedule over the lookups, priced by the
    decoder's measured pass costs, on the first method's output (``specdecode.bench.oracle``)."""
    from specdecode.bench.oracle import CostTable, best_schedule, turn_proposals
    from specdecode.drafters.suffix import AUTO_DEPTH
    from specdecode.drafters.suffix_cache import SuffixCache

    costs = CostTable.of(dec, AUTO_DEPTH + 1)  # as many rows as auto's deepest draft, as bench --oracle
    plain_total = oracle_total = 0.0
    for (name, prompt, _), row in zip(SET, rows):
        y = row[methods[0]]["token_ids"]
        ids = dec.encode([{"role": "user", "content": prompt}], chat=True)
        seconds, _ = best_schedule(turn_proposals(dec, ids, y, SuffixCache(), suffix_trees=False), costs)
        plain = costs.target(1) * (len(y) - 1)
        plain_total, oracle_total = plain_total + plain, oracle_total + seconds
        row["oracle_ceiling"] = plain / seconds if seconds else None
        print(f"{name:32s} oracle ceiling {plain / seconds:.2f}x" if seconds else f"{name:32s} (one token)")
    rows_cost = ", ".join(f"{r}: {costs.target(r) / costs.target(1):.2f}" for r in (2, 3, 4, 6, 8))
    print(f"oracle ceiling over the set: {plain_total / oracle_total:.2f}x (pass over r rows / one row: {rows_cost})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="llama.cpp")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--methods", default="none,auto")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--oracle", action="store_true",
                        help="also the oracle ceiling of each schema's first-method output (bench --oracle's DP: "
                             "prompt lookup and suffix decoding, this machine's pass costs; forced tokens not counted)")
    args = parser.parse_args()
    methods = args.methods.split(",")
    dec = SpecDecoder.from_pretrained(backend=args.backend, method="auto", show_progress=False)
    dec.generate("warm", SamplingParams(max_new_tokens=4, structured=StructuredOutput(json_object=True)),
                 method="none")  # the grammar engine's tokenizer info, the first pass
    # auto's pass costs are timed on its first use: not inside the first schema's request.
    dec.generate("warm", SamplingParams(max_new_tokens=4, structured=StructuredOutput(json_object=True)), method="auto")
    rows = []
    for name, prompt, schema in SET:
        row = {"schema": name, **{m: run(dec, m, prompt, schema, args.tokens) for m in methods}}
        base = row[methods[0]]
        parts = [f"{name:32s}"]
        for m in methods:
            r = row[m]
            parts.append(f"{m}: {r['tokens']:3d} tok {r['seconds']:6.2f} s valid={r['valid']!s:5s} tau={r['tau']:.2f}")
        same = all(row[m]["token_ids"] == base["token_ids"] for m in methods)
        parts.append(f"same output: {same}")
        print("  ".join(parts), flush=True)
        rows.append(row)
    first = methods[0]
    for m in methods[1:]:
        whole = sum(r[first]["seconds"] for r in rows) / sum(r[m]["seconds"] for r in rows)
        decode = sum(r[first]["decode_seconds"] for r in rows) / sum(r[m]["decode_seconds"] for r in rows)
        print(f"{m} against {first}: {whole:.2f}x whole requests, {decode:.2f}x decode only")
    for m in methods:
        valid = sum(r[m]["valid"] for r in rows)
        grammar = sum(r[m]["grammar_seconds"] for r in rows) / sum(r[m]["tokens"] for r in rows)
        forced = sum(r[m]["forced_proposed"] for r in rows)
        forced_ok = sum(r[m]["forced_accepted"] for r in rows)
        tokens = sum(r[m]["tokens"] for r in rows)
        steps = sum(r[m]["steps"] for r in rows)
        print(f"{m}: {valid}/{len(rows)} valid, grammar {grammar * 1e3:.2f} ms/token, {tokens} tokens in {steps} "
              f"steps, forced tokens {forced_ok}/{forced} accepted")
    if args.oracle:
        oracle_ceiling(dec, rows, methods)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"tokens": args.tokens, "backend": args.backend, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

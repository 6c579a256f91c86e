"""A bench run's sessions decoded again for real, every pass the decoder ran priced by one table:
a comparison of methods, or of two checkouts, that this machine's speed drift does not move
(issue 45).

    specdecode bench --methods none@llama.cpp,auto@llama.cpp --prompts agentic \\
        --max-new-tokens 256 --oracle --out agentic
    python benchmarks/priced_sessions.py agentic/results.json --methods auto --repeats 3
    PYTHONPATH=other-checkout/src python benchmarks/priced_sessions.py agentic/results.json ...

``auto_policy_sim.py`` and ``lookup_bound.py`` replay a policy offline on the run's outputs with
a fixed table; here the decoder itself runs, so what is priced is what it did: its outputs
(which may part from plain decoding's at a near-tie), its decisions as its live pass costs
steered them, its draft model's passes. Only the clock is replaced: each traced pass
(``SpecDecoder.trace_passes``) is priced at its row count by one table
(``bench/oracle.price_trace``: prefill and the first token left out), this machine's stored one
or ``--verify-ms``. Timed runs minutes apart drifted by a fifth here (benchmarks/RESULTS.md,
2026-12-07); priced ones differ only where the decoder decided differently.

Each later turn's conversation holds plain decoding's earlier answers from the run, as the
bench's do, so every method and checkout sees the same prompts. Each (repeat, method) starts
with empty suffix and prefix caches and keeps them across the run's sessions, as a server
would. Printed: priced and measured decode tokens per second per session, and over the later
turns (a session's first turn has little to copy) per method and repeat, with the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from specdecode import SamplingParams, SpecDecoder
from specdecode.bench.oracle import CostTable, max_trace_rows, price_trace
from specdecode.costs.k_policy import interpolate
from specdecode.engine.trace import PassTrace


@dataclass(frozen=True, slots=True)
class TurnRun:
    session: int
    turn: int
    tokens: int  # generated, the first included
    trace: PassTrace
    measured_seconds: float  # decode wall time after the first token


def run_sessions(decoder: SpecDecoder, sessions: Sequence[Sequence[Sequence[int]]], method: str,
                 max_new_tokens: int) -> list[TurnRun]:
    """Decode every turn (``sessions[s][t]``: the prompt's token ids) with ``method``, tracing
    its passes; the suffix and prefix caches start empty and carry across sessions."""
    decoder.suffix_cache.clear()
    decoder.forget_prefix()
    params = SamplingParams(max_new_tokens=max_new_tokens)
    runs = []
    for s, turns in enumerate(sessions):
        for t, ids in enumerate(turns):
            with decoder.trace_passes() as trace:
                result = decoder.generate(list(ids), params, method=method)
            stats = result.stats
            runs.append(TurnRun(s, t, len(result.token_ids), trace, stats.total_seconds - stats.first_token_seconds))
    return runs


def cost_table(decoder: SpecDecoder, rows: int, verify_ms: str | None) -> CostTable:
    """The decoder's table over 1..rows rows, or one given as rows:ms pairs (interpolated)."""
    costs = CostTable.of(decoder, rows)
    if not verify_ms:
        return costs
    table = {int(r): float(ms) / 1e3 for r, ms in (pair.split(":") for pair in verify_ms.split(","))}
    return CostTable(tuple(interpolate(table, r) for r in range(1, rows + 1)), costs.draft_pass, costs.draft_token)


def later_turn_rates(runs: Sequence[TurnRun], costs: CostTable) -> tuple[float, float]:
    """(priced, measured) decode tokens per second over every turn but each session's first."""
    later = [r for r in runs if r.turn > 0 and r.tokens > 1]
    tokens = sum(r.tokens - 1 for r in later)
    if not tokens:
        return 0.0, 0.0
    return tokens / sum(price_trace(r.trace, costs) for r in later), tokens / sum(r.measured_seconds for r in later)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a bench run's results.json holding plain decoding's outputs (method none)")
    parser.add_argument("--target", default=None, help="the run's target (its tokenizer encodes the prompts)")
    parser.add_argument("--methods", default="auto", help="comma-separated methods, alternated within each repeat")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's")
    parser.add_argument("--verify-ms", default=None,
                        help="price with this table, rows:ms pairs (verify_rows_logits.py --context 1024's output)")
    args = parser.parse_args()
    run = json.load(open(args.results))
    plain_key = next(r["method"] for r in run["records"] if r["method"].partition("@")[0] == "none")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    decoder = SpecDecoder.from_pretrained(args.target, method=methods[0], backend=plain_key.partition("@")[2] or "auto",
                                          show_progress=False)
    records = {(r["method"], r["prompt_id"]): r for r in run["records"]}
    names, sessions = [], []
    for prompt in run["prompts"]:
        record = records.get((plain_key, prompt["prompt_id"]))
        if record is None or record["error"] or not record["repeats"]:
            continue
        messages: list[dict[str, str]] = []
        turns = []
        for turn, plain in zip(prompt["turns"], record["repeats"][0]):
            messages.append({"role": "user", "content": turn})
            turns.append(decoder.encode(messages, chat=True))
            messages.append({"role": "assistant", "content": plain["text"]})
        names.append(prompt["prompt_id"])
        sessions.append(turns)
    max_new = args.max_new_tokens or run["config"]["max_new_tokens"]
    results: dict[str, list[list[TurnRun]]] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for method in methods:
            results[method].append(run_sessions(decoder, sessions, method, max_new))
    rows = max_trace_rows([r.trace for runs in results.values() for repeat in runs for r in repeat])
    costs = cost_table(decoder, rows, args.verify_ms)
    print("pass seconds by rows:", {r: round(costs.target(r), 4) for r in sorted({1, 2, 4, 8, 16, 32, 64, rows}) if r <= rows})
    for method in methods:
        for i, repeat in enumerate(results[method]):
            per_session = []
            for s, name in enumerate(names):
                turns = [r for r in repeat if r.session == s]
                tokens = sum(r.tokens - 1 for r in turns)
                priced = sum(price_trace(r.trace, costs) for r in turns)
                per_session.append(f"{name.rpartition(':')[2]} {tokens / priced:.1f}")
            priced, measured = later_turn_rates(repeat, costs)
            print(f"{method} repeat {i + 1}: later turns priced {priced:.2f} tok/s, measured {measured:.2f}; "
                  f"sessions priced: {', '.join(per_session)}")
        medians = [later_turn_rates(repeat, costs) for repeat in results[method]]
        print(f"{method}: later turns, median priced {statistics.median(p for p, _ in medians):.2f} tok/s, "
              f"measured {statistics.median(m for _, m in medians):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

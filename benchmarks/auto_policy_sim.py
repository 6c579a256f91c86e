"""Replay ``auto``'s lookup decisions offline against a bench run's greedy outputs, priced by its
cost table: how a change to auto's policy moves its share of the oracle ceiling, in seconds
instead of a 10-minute bench run (issue 33).

    python benchmarks/auto_policy_sim.py benchmarks/results/oracle/llamacpp-longmem/results.json

For every prompt of the run, in the run's order, the target's greedy output ``y`` (plain
decoding's, from the results) is decoded again by an ``AutoDrafter`` over prompt lookup and
suffix decoding: each step it proposes as in a real run, the target accepts the drafted run
that equals ``y``, and the step is charged the run's measured price of a pass over k + 1 rows.
The draft model is left out: on the run's cost table it cannot pay even when every draft is
accepted (``speculation_can_pay``), so auto never drafts with it there. Each prompt starts with
an empty suffix cache that keeps its calibration memory, as the bench's runs do (``clear``).
Printed per category: plain, oracle and simulated seconds, and the share
(oracle / simulated), beside the share the real run measured.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from specdecode import SpecDecoder
from specdecode.bench.oracle import CostTable
from specdecode.config import DEFAULT_K_MAX, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN
from specdecode.core.sampling import LogitsProcessor
from specdecode.costs.batch_k import BatchK, PassCosts
from specdecode.drafters.auto import AutoDrafter
from specdecode.drafters.auto_row import AutoRow
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import AUTO_DEPTH, SuffixDrafter, SuffixProposer, auto_depth
from specdecode.drafters.suffix_cache import DEFAULT_GROUP, SuffixCache


def simulate_turn(prompt: list[int], y: list[int], costs: CostTable, cache: SuffixCache, sources: dict[str, int]) -> float:
    """Priced seconds of auto decoding ``y`` after ``prompt`` (prefill excluded, as the oracle's)."""
    depth = AUTO_DEPTH
    verify = [costs.target(rows) for rows in range(1, depth + 2)]
    suffix = SuffixDrafter(SuffixProposer(cache, DEFAULT_GROUP, depth=depth, verify_seconds=verify))
    auto = AutoDrafter(NgramDrafter(DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN), None, verify, DEFAULT_K_MAX,
                       live_costs=False, suffix=suffix, suffix_depth=depth)
    n = len(y)
    auto.start(len(prompt), len(prompt) + n + 1)
    auto.on_committed(list(prompt))
    auto.on_committed([y[0]])
    committed = list(prompt) + [y[0]]
    processor = LogitsProcessor(temperature=0.0, top_k=0, top_p=1.0)
    seconds, i = 0.0, 1
    while i < n:
        k = min(auto.next_k(), auto.k, n - i - 1)
        drafted = auto.propose(torch.tensor([committed]), k, processor, None).tokens[0].tolist() if k > 0 else []
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == y[i + accepted]:
            accepted += 1
        cost = costs.target(len(drafted) + 1)
        if drafted:
            auto.on_verified(accepted)
        auto.observe(len(drafted), accepted, 0.0, 0, cost)
        sources[auto.source if drafted else "none"] += 1
        new = y[i : i + accepted + 1]
        committed.extend(new)
        auto.on_committed(new)
        seconds += cost
        i += accepted + 1
    suffix.proposer.close()
    return seconds


def simulate_turn_batch(prompt: list[int], y: list[int], costs: CostTable, cache: SuffixCache,
                        sources: dict[str, int]) -> float:
    """As ``simulate_turn``, but the batch engine's auto (the default engine's: a batch of one):
    an ``AutoRow`` offers its lookups each step, ``BatchK`` picks the source and draft length."""
    depth = auto_depth(DEFAULT_K_MAX)
    verify = [costs.target(rows) for rows in range(1, depth + 2)]
    chooser = BatchK(DEFAULT_K_MAX, PassCosts(dict(enumerate(verify, start=1)), live=False, flat=True))
    suffix = SuffixDrafter(SuffixProposer(cache, DEFAULT_GROUP, depth=depth, verify_seconds=verify))
    row = AutoRow(NgramDrafter(DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN), suffix, ngram_cap=DEFAULT_K_MAX)
    n = len(y)
    row.start(len(prompt), len(prompt) + n + 1)
    committed = list(prompt) + [y[0]]  # the prompt's pass emits the first token
    seconds, i = 0.0, 1
    while i < n:
        row.extend(committed[len(row.history):])  # as plan_row: every committed token, then the offers
        plan = row.choices(n - i, None)
        k = chooser.choose([plan], 1)
        pick = chooser.pick(plan, k, 1) if k > 0 else None
        row.choose(pick.index if pick is not None else None)
        drafted = row.match(pick.k)[0] if pick is not None else []
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == y[i + accepted]:
            accepted += 1
        cost = costs.target(len(drafted) + 1)
        chooser.observe([len(drafted) + 1], len(drafted), cost, 0, 0, 0.0)
        row.observe(len(drafted))
        sources[row.source if drafted else "none"] += 1
        committed.extend(y[i : i + accepted + 1])
        seconds += cost
        i += accepted + 1
    suffix.proposer.close()
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a bench run's results.json with --oracle, none and auto on one backend")
    parser.add_argument("--target", default=None, help="the run's target (its tokenizer encodes the prompts)")
    parser.add_argument("--engine", choices=("batch", "single"), default="batch",
                        help="whose auto to replay: the batch engine's (the default) or the single path's")
    args = parser.parse_args()
    simulate = simulate_turn_batch if args.engine == "batch" else simulate_turn
    run = json.load(open(args.results))
    (plain_key, group), = run["oracle"].items()
    costs = CostTable(tuple(group["cost_table"]["verify_seconds"]))
    auto_key = next(m for m in group["methods"] if m.startswith("auto"))
    decoder = SpecDecoder.from_pretrained(args.target, method="none", backend=plain_key.partition("@")[2] or "auto",
                                          show_progress=False)
    records = {(r["method"], r["prompt_id"]): r for r in run["records"]}
    oracle_rows = {row["prompt_id"]: row for row in group["prompts"]}
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    cache = SuffixCache()
    for prompt in run["prompts"]:
        row = oracle_rows.get(prompt["prompt_id"])
        if row is None:
            continue
        plain_turns = records[plain_key, prompt["prompt_id"]]["repeats"][0]
        cache.clear()  # the earlier prompts' responses go, their calibration stays (as the bench)
        messages: list[dict[str, str]] = []
        seconds = 0.0
        sources: dict[str, int] = defaultdict(int)
        for turn, plain in zip(prompt["turns"], plain_turns):
            messages.append({"role": "user", "content": turn})
            ids = decoder.encode(messages, chat=True)
            seconds += simulate(ids, plain["tokens"], costs, cache, sources)
            messages.append({"role": "assistant", "content": plain["text"]})
        measured = row["methods"][auto_key]
        print(f"{prompt['prompt_id']:>16} {row['category']:<15} share sim {row['oracle_seconds'] / seconds:.2f} "
              f"run {measured['share']:.2f}  steps {dict(sources)}")
        for cat in (row["category"], "all"):
            totals[cat]["plain"] += row["plain_seconds"]
            totals[cat]["oracle"] += row["oracle_seconds"]
            totals[cat]["sim"] += seconds
            totals[cat]["run"] += row["oracle_seconds"] / measured["share"]
    print(f"{'category':<15} {'ceiling':>8} {'sim share':>10} {'run share':>10}")
    for cat, t in totals.items():
        print(f"{cat:<15} {t['plain'] / t['oracle']:>7.2f}x {t['oracle'] / t['sim']:>10.2f} {t['oracle'] / t['run']:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

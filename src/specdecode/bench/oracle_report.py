"""The oracle over a whole bench run (``specdecode bench --oracle``): which methods one cost
table prices, every greedy prompt's ceiling and each method's traced passes priced beside it,
pooled per category, recomputed for a stored run, and the report's tables.

The ceiling of one turn (what each drafter would propose, the hindsight-best schedule, a trace
priced) is ``bench/oracle.py``; this module applies it to a run's records and traces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specdecode.bench.oracle import (
    PLAIN_SOURCE,
    SOURCES,
    CostTable,
    best_schedule,
    max_trace_rows,
    price_trace,
    turn_proposals,
)
from specdecode.drafters.suffix import AUTO_DEPTH
from specdecode.drafters.suffix_cache import SuffixCache
from specdecode.engine.trace import PassTrace
from specdecode.errors import InvalidRequestError

ORACLE_BASES = ("none", "draft", "ngram", "suffix", "auto")  # methods whose every pass a trace holds
ALL = "all"


def check_oracle_config(methods: Sequence[str], greedy: bool, plain_methods: Sequence[str]) -> None:
    """The oracle needs the target's greedy output, from a plain decoding in the run."""
    if not greedy:
        raise InvalidRequestError("--oracle needs greedy decoding (temperature 0): it schedules against the target's "
                                  "one greedy output.")
    if not any(m in methods for m in plain_methods):
        raise InvalidRequestError(f"--oracle needs plain decoding in the run ({' or '.join(plain_methods)}): its "
                                  "greedy output is what the drafters are scored against.")


@dataclass(slots=True)
class OracleGroup:
    """The methods one cost table prices: those whose plain decoding is ``plain`` (one backend,
    the unquantized target), and the decoder whose drafters and costs the oracle reads."""

    plain: str  # "none" or "none@llama.cpp"
    decoder: Any  # SpecDecoder with the draft model where the run has one
    methods: list[str]

    @property
    def speedup_key(self) -> str:
        """The summary's measured decode speedup against ``plain`` (report.DECODE_BASELINES)."""
        from specdecode.bench.report import DECODE_BASELINES

        return dict(DECODE_BASELINES)[self.plain]


def _sum(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) else float(sum(values))  # type: ignore[arg-type]


def oracle_results(
    groups: Sequence[OracleGroup],
    prompts: Sequence[Any],  # BenchPrompt: prompt_id, category, turns
    records: Sequence[dict[str, Any]],
    traces: dict[tuple[str, str, int], list[PassTrace]],  # (method, prompt id, repeat) -> a trace per turn
    encode: Any,  # messages -> prompt ids, as the bench encoded them
    summary: dict[str, dict[str, dict[str, Any]]],
    progress: Any = None,
) -> dict[str, Any]:
    """``results["oracle"]``: per group, the cost table, and per prompt and category (and all)
    the plain, oracle and each method's priced seconds, the ceiling (plain / oracle) and each
    method's share of it (oracle / method), with its measured decode speedup beside."""
    from specdecode.bench.report import chosen_repeat

    by_key = {(r["method"], r["prompt_id"]): r for r in records}
    rows = max(AUTO_DEPTH + 1, max_trace_rows([t for turns in traces.values() for t in turns]))
    out: dict[str, Any] = {}
    for group in groups:
        chosen = {}  # (method, prompt id) -> (repeat index, turns)
        for (method, prompt_id), record in by_key.items():
            if method in group.methods + [group.plain] and not record["error"] and record["repeats"]:
                turns = chosen_repeat(record)
                chosen[method, prompt_id] = (record["repeats"].index(turns), turns)
        costs = CostTable.of(group.decoder, rows)
        per_prompt = []
        for prompt in prompts:
            if (group.plain, prompt.prompt_id) not in chosen:
                continue
            _, plain_turns = chosen[group.plain, prompt.prompt_id]
            cache = SuffixCache()  # the conversation's earlier answers, as each method's run had
            messages: list[dict[str, str]] = []
            oracle_seconds, steps_by_source = 0.0, dict.fromkeys((PLAIN_SOURCE,) + SOURCES, 0)
            for turn, plain in zip(prompt.turns, plain_turns):
                messages.append({"role": "user", "content": turn})
                proposals = turn_proposals(group.decoder, encode(messages), plain["tokens"], cache,
                                           suffix_trees=group.decoder.backend == "torch")
                seconds, steps = best_schedule(proposals, costs)
                oracle_seconds += seconds
                for step in steps:
                    steps_by_source[step.source] += 1
                messages.append({"role": "assistant", "content": plain["text"]})
            group.decoder.forget_prefix()
            plain_seconds = _price(traces, group.plain, prompt.prompt_id, chosen, costs)
            row: dict[str, Any] = {
                "prompt_id": prompt.prompt_id, "category": prompt.category,
                "tokens": sum(len(t["tokens"]) for t in plain_turns),
                "plain_seconds": plain_seconds, "oracle_seconds": oracle_seconds,
                "ceiling": plain_seconds / oracle_seconds if plain_seconds and oracle_seconds else None,
                "oracle_steps_by_source": steps_by_source, "methods": {},
            }
            for method in group.methods:
                if (method, prompt.prompt_id) not in chosen:
                    continue
                turns = chosen[method, prompt.prompt_id][1]
                priced = _price(traces, method, prompt.prompt_id, chosen, costs)
                row["methods"][method] = {"priced_seconds": priced, "tokens": sum(len(t["tokens"]) for t in turns),
                                          "equal_to_plain": [t["tokens"] for t in turns] == [t["tokens"] for t in plain_turns]}
            _set_shares(row)
            per_prompt.append(row)
            if progress is not None:
                progress()
        out[group.plain] = {"cost_table": costs.to_json(), "methods": list(group.methods), "prompts": per_prompt,
                            "categories": _by_category(per_prompt, group, summary)}
    return out


def _price(traces: dict[tuple[str, str, int], list[PassTrace]], method: str, prompt_id: str,
           chosen: dict[tuple[str, str], tuple[int, list[dict[str, Any]]]], costs: CostTable) -> float | None:
    repeat, _ = chosen[method, prompt_id]
    turn_traces = traces.get((method, prompt_id, repeat))
    return sum(price_trace(t, costs) for t in turn_traces) if turn_traces else None


def _set_shares(row: dict[str, Any]) -> None:
    """Each method's share of one prompt's ceiling: oracle seconds over the method's priced
    seconds. Where its output parted from plain decoding's (a near-tie on a backend whose
    multi-row passes round otherwise), its seconds are scaled to the plain output's length first:
    an approximation, flagged by ``equal_to_plain``."""
    for figures in row["methods"].values():
        priced, tokens = figures["priced_seconds"], figures["tokens"]
        scaled = priced * row["tokens"] / tokens if priced and tokens else None
        figures["scaled_seconds"] = scaled
        figures["share"] = row["oracle_seconds"] / scaled if scaled else None


def rescore(oracle: dict[str, Any], records: Sequence[dict[str, Any]],
            summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """A stored run's oracle block with its shares and categories recomputed by this version's
    code (``bench --from-results``); what was measured and priced stays."""
    from specdecode.bench.report import chosen_repeat

    by_key = {(r["method"], r["prompt_id"]): r for r in records}
    for plain, group in oracle.items():
        for row in group["prompts"]:
            for method, figures in row["methods"].items():
                if "tokens" not in figures:  # a run from before the field
                    figures["tokens"] = sum(len(t["tokens"]) for t in chosen_repeat(by_key[method, row["prompt_id"]]))
            _set_shares(row)
        group["categories"] = _by_category(group["prompts"], OracleGroup(plain, None, group["methods"]), summary)
    return oracle


def _by_category(per_prompt: list[dict[str, Any]], group: OracleGroup,
                 summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Seconds pooled per category (and all): the ceiling, and each method's share over its
    prompts (scaled to the plain output's length where its output parted; how many did, beside)."""
    categories = list(dict.fromkeys(r["category"] for r in per_prompt)) + [ALL]
    out = {}
    for category in categories:
        rows = [r for r in per_prompt if category in (ALL, r["category"])]
        plain, oracle = _sum([r["plain_seconds"] for r in rows]), sum(r["oracle_seconds"] for r in rows)
        methods = {}
        for method in group.methods:
            kept = [r for r in rows if (r["methods"].get(method) or {}).get("share") is not None]
            priced = sum(r["methods"][method]["scaled_seconds"] for r in kept)
            methods[method] = {
                "share": sum(r["oracle_seconds"] for r in kept) / priced if priced else None,
                "priced_speedup": sum(r["plain_seconds"] for r in kept) / priced if priced else None,
                "measured_decode_speedup": (summary.get(method, {}).get(category) or {}).get(group.speedup_key),
                "prompts": len(kept),
                "parted_from_plain": sum(not r["methods"][method]["equal_to_plain"] for r in kept),
            }
        out[category] = {"prompts": len(rows), "plain_seconds": plain, "oracle_seconds": oracle,
                         "ceiling": plain / oracle if plain and oracle else None, "methods": methods}
    return out


def oracle_rows(oracle: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) per group: a category per row, the ceiling, then each method's
    share of it and its measured decode speedup."""
    tables = []
    for plain, group in oracle.items():
        methods = [m for m in group["methods"] if m != plain]
        header = ["category", "ceiling"] + [f"{m} share (measured)" for m in methods]
        rows = []
        for category, entry in group["categories"].items():
            cells = [category, "-" if entry["ceiling"] is None else f"{entry['ceiling']:.2f}x"]
            for method in methods:
                figures = entry["methods"][method]
                share, measured = figures["share"], figures["measured_decode_speedup"]
                parted = "*" if figures.get("parted_from_plain") else ""
                cells.append(("-" if share is None else f"{share:.0%}{parted}")
                             + ("" if measured is None else f" ({measured:.2f}x)"))
            rows.append(cells)
        title = (f"Oracle ceiling against {plain}: plain / hindsight-best schedule of the same drafters, priced with "
                 "this machine's pass costs (prefill left out); each method's share = oracle / its own trace priced "
                 "alike (*: on some prompts its output parted from plain decoding's, its seconds scaled to the plain "
                 "output's length), its measured decode speedup in brackets")
        tables.append((title, header, rows))
    return tables

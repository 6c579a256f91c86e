"""From raw benchmark records to the figures users compare, computed one right way.

Aggregation rules (the places hand-collected numbers usually go wrong):
- tokens/s of a group is its total new tokens over its total seconds, not a mean of rates;
- speedups compare two methods on the same prompts of the same run (prompts where either
  failed are left out of that ratio);
- tau is total tokens emitted by verify steps over total verify steps (bonus token counted),
  and acceptance is total accepted over total proposed draft tokens: both pooled over steps,
  never averaged over prompts, so long and short generations weigh by their steps;
- acceptance at draft position i pools steps that proposed at least i + 1 tokens;
- with repeats, each prompt contributes the repeat with the median wall time.

A record is one (prompt, method) pair: ``{"prompt_id", "category", "subcategory", "method",
"repeats": [[turn, ...], ...], "error"}`` where a turn is a ``TurnResult.to_dict()``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from .methods import HF_PLAIN_METHOD, PLAIN_METHOD, plain_counterpart
from .roofline import ceiling_tokens_per_second

ALL = "all"


def equality_reference(method: str, methods: Sequence[str]) -> str | None:
    """Whose greedy output a method must equal: its own library's plain decoding; the two
    plain decodings (``none``, ``hf``) are checked against each other (library parity)."""
    reference = plain_counterpart(method)
    if reference == method:
        reference = HF_PLAIN_METHOD if method == PLAIN_METHOD else PLAIN_METHOD
    return reference if reference in methods else None


def chosen_repeat(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The turns of the repeat whose total wall time is the median (the lower one if even)."""
    repeats = sorted(record["repeats"], key=lambda turns: sum(t["seconds"] for t in turns))
    return repeats[(len(repeats) - 1) // 2]


def first_difference(turns: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, int] | None:
    """None when every turn's tokens are equal, else the first (turn, token position) that differs."""
    for turn_index, (ours, theirs) in enumerate(zip(turns, reference)):
        a, b = ours["tokens"], theirs["tokens"]
        if a != b:
            position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {"turn": turn_index, "position": position}
    if len(turns) != len(reference):
        return {"turn": min(len(turns), len(reference)), "position": 0}
    return None


def _ratio(ours: dict[str, list[dict[str, Any]]], theirs: dict[str, list[dict[str, Any]]]) -> float | None:
    """Total-tokens-over-total-seconds of ``ours`` over that of ``theirs`` on their common prompts."""
    common = [p for p in ours if p in theirs]
    if not common:
        return None
    def rate(runs: dict[str, list[dict[str, Any]]]) -> float:
        tokens = sum(len(t["tokens"]) for p in common for t in runs[p])
        seconds = sum(t["seconds"] for p in common for t in runs[p])
        return tokens / seconds if seconds > 0 else 0.0
    base = rate(theirs)
    return rate(ours) / base if base > 0 else None


def aggregate(
    runs: dict[str, list[dict[str, Any]]],  # prompt_id -> turns (chosen repeat), one method, one group
    failed: int,
    target_bytes: int,
    draft_bytes: int,
    bandwidth: float | None,
) -> dict[str, Any]:
    turns = [t for prompt_turns in runs.values() for t in prompt_turns]
    new_tokens = sum(len(t["tokens"]) for t in turns)
    seconds = sum(t["seconds"] for t in turns)
    entry: dict[str, Any] = {"prompts": len(runs), "failed": failed, "new_tokens": new_tokens, "seconds": seconds}
    if not turns:
        return entry
    per_prompt = [
        sum(len(t["tokens"]) for t in ts) / sum(t["seconds"] for t in ts) for ts in runs.values() if sum(t["seconds"] for t in ts) > 0
    ]
    steps = sum(t["verify_steps"] for t in turns)
    proposed = [t["draft_tokens_proposed"] for t in turns]
    accepted = [t["draft_tokens_accepted"] for t in turns]
    known = all(p is not None for p in proposed) and sum(proposed) > 0
    depth = max((len(t["proposed_at_position"]) for t in turns), default=0)
    at_pos_proposed = [sum(t["proposed_at_position"][i] for t in turns if i < len(t["proposed_at_position"])) for i in range(depth)]
    at_pos_accepted = [sum(t["accepted_at_position"][i] for t in turns if i < len(t["accepted_at_position"])) for i in range(depth)]
    split = {name: sum(t[f"{name}_seconds"] for t in turns) for name in ("prefill", "draft", "verify")}
    split["other"] = max(0.0, seconds - sum(split.values()))
    target_passes = sum(t["target_passes"] for t in turns)
    draft_passes = sum(t["draft_passes"] for t in turns)
    rss = [t["peak_rss_bytes"] for t in turns if t.get("peak_rss_bytes")]
    run_rss = [t["run_rss_bytes"] for t in turns if t.get("run_rss_bytes") is not None]
    entry.update(
        tokens_per_second=new_tokens / seconds if seconds > 0 else None,
        tokens_per_second_median=statistics.median(per_prompt) if per_prompt else None,
        tau=sum(t["emitted_by_steps"] for t in turns) / steps if steps else None,
        acceptance_rate=sum(accepted) / sum(proposed) if known else None,
        acceptance_per_position=[a / p for a, p in zip(at_pos_accepted, at_pos_proposed) if p] if known else [],
        draft_passes_per_step=draft_passes / steps if steps else None,
        target_passes=target_passes,
        draft_passes=draft_passes,
        time_split={name: value / seconds if seconds > 0 else 0.0 for name, value in split.items()},
        peak_rss_bytes=max(rss) if rss else None,
        run_rss_bytes=max(run_rss) if run_rss else None,
    )
    if bandwidth:
        ceiling = ceiling_tokens_per_second(new_tokens, target_passes, draft_passes, target_bytes, draft_bytes, bandwidth)
        entry["ceiling_tokens_per_second"] = ceiling
        entry["fraction_of_ceiling"] = entry["tokens_per_second"] / ceiling if ceiling and entry["tokens_per_second"] else None
    return entry


def summarize(
    records: Sequence[dict[str, Any]],
    methods: Sequence[str],
    greedy: bool,
    target_bytes: int,
    draft_bytes: int,
    bandwidth: float | None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """``summary[method][category]`` (plus ``"all"``) with every aggregate figure."""
    categories = list(dict.fromkeys(r["category"] for r in records))
    # runs[method][category][prompt_id] = chosen turns
    runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {m: {} for m in methods}
    failures: dict[str, dict[str, int]] = {m: {} for m in methods}
    for record in records:
        method, category = record["method"], record["category"]
        if method not in runs:
            continue
        if record.get("error") or not record["repeats"]:
            failures[method][category] = failures[method].get(category, 0) + 1
            continue
        runs[method].setdefault(category, {})[record["prompt_id"]] = chosen_repeat(record)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for method in methods:
        summary[method] = {}
        groups = {c: runs[method].get(c, {}) for c in categories}
        groups[ALL] = {p: ts for c in categories for p, ts in runs[method].get(c, {}).items()}
        for group, group_runs in groups.items():
            failed = sum(failures[method].values()) if group == ALL else failures[method].get(group, 0)
            entry = aggregate(group_runs, failed, target_bytes, draft_bytes if _reads_draft(group_runs) else 0, bandwidth)
            entry.update(speedup_vs_none=None, speedup_vs_hf=None, equality=None)
            for baseline, key in ((PLAIN_METHOD, "speedup_vs_none"), (HF_PLAIN_METHOD, "speedup_vs_hf")):
                if baseline in runs:
                    base_runs = {c: runs[baseline].get(c, {}) for c in categories}
                    base = {p: ts for c in categories for p, ts in base_runs[c].items()} if group == ALL else base_runs[group]
                    entry[key] = _ratio(group_runs, base)
            reference = equality_reference(method, methods)
            if greedy and reference is not None and group_runs:
                ref_runs = {p: ts for c in categories for p, ts in runs[reference].get(c, {}).items()}
                compared = {p: first_difference(ts, ref_runs[p]) for p, ts in group_runs.items() if p in ref_runs}
                entry["equality"] = {
                    "reference": reference,
                    "prompts_compared": len(compared),
                    "equal_fraction": sum(d is None for d in compared.values()) / len(compared) if compared else None,
                    "first_differences": {p: d for p, d in compared.items() if d is not None},
                }
            summary[method][group] = entry
    return summary


def _reads_draft(group_runs: dict[str, list[dict[str, Any]]]) -> bool:
    return any(t["draft_passes"] for ts in group_runs.values() for t in ts)

"""From raw benchmark records to the figures users compare, computed one right way.

Aggregation rules (the places hand-collected numbers usually go wrong):
- tokens/s of a group is its total new tokens over its total seconds, not a mean of rates;
- speedups compare two methods on the same prompts of the same run (prompts where either
  failed are left out of that ratio); the decode speedup does the same with the seconds after
  prefill only (the same prompt pass for every method);
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specdecode.bench.methods import (
    HF_PLAIN_METHOD,
    LLAMACPP_PLAIN_PEER,
    PLAIN_LLAMACPP_METHOD,
    PLAIN_METHOD,
    plain_counterpart,
)
from specdecode.bench.roofline import ceiling_tokens_per_second

ALL = "all"


# A plain decoding's own reference, first present wins: library parity (none against hf,
# llama-cpp-python's plain decoding against ours on the same backend) or backend parity.
PLAIN_REFERENCES = {
    PLAIN_METHOD: (HF_PLAIN_METHOD,),
    HF_PLAIN_METHOD: (PLAIN_METHOD,),
    LLAMACPP_PLAIN_PEER: (PLAIN_LLAMACPP_METHOD, PLAIN_METHOD),
}
# Baselines every method's speed is compared with, where the run has them.
SPEEDUP_BASELINES = ((PLAIN_METHOD, "speedup_vs_none"), (HF_PLAIN_METHOD, "speedup_vs_hf"), (PLAIN_LLAMACPP_METHOD, "speedup_vs_none_llamacpp"))
DECODE_BASELINES = ((PLAIN_METHOD, "decode_speedup_vs_none"), (PLAIN_LLAMACPP_METHOD, "decode_speedup_vs_none_llamacpp"))


def equality_reference(method: str, methods: Sequence[str]) -> str | None:
    """Whose greedy output a method must equal: its own library's plain decoding on the same
    backend (of the same quantized target); the plain decodings are checked against each other
    (``none`` and ``hf``; ``llamacpp`` against ``none@llama.cpp``: library parity), and plain
    decoding of a quantized target or on llama.cpp against ``none`` (how often quantization or
    another backend's arithmetic leaves the output unchanged)."""
    reference = plain_counterpart(method)
    if reference != method:
        return reference if reference in methods else None
    return next((r for r in PLAIN_REFERENCES.get(method, (PLAIN_METHOD,)) if r in methods), None)


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


def _rate(turns: list[dict[str, Any]]) -> float | None:
    """Total new tokens over total seconds."""
    seconds = sum(t["seconds"] for t in turns)
    return sum(len(t["tokens"]) for t in turns) / seconds if seconds > 0 else None


def _decode_rate(turns: list[dict[str, Any]]) -> float | None:
    """Total new tokens over total seconds after prefill.

    Why a second rate: prefill (the prompt's pass, which also yields the first token) costs the
    same whatever the method, so on long prompts it dilutes every method's speedup towards 1x;
    quantization speeds prefill up less than decoding (prefill is compute-bound). This is the
    speed of the decoding loop itself."""
    seconds = sum(t["seconds"] - t["prefill_seconds"] for t in turns)
    return sum(len(t["tokens"]) for t in turns) / seconds if seconds > 0 else None


def _ratio(
    ours: dict[str, list[dict[str, Any]]],
    theirs: dict[str, list[dict[str, Any]]],
    rate: Callable[[list[dict[str, Any]]], float | None] = _rate,
) -> float | None:
    """The rate of ``ours`` over that of ``theirs``, both on their common prompts only."""
    common = [p for p in ours if p in theirs]
    ours_rate = rate([t for p in common for t in ours[p]])
    base_rate = rate([t for p in common for t in theirs[p]])
    return ours_rate / base_rate if ours_rate is not None and base_rate else None


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
    per_prompt = [rate for rate in map(_rate, runs.values()) if rate is not None]
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
    suffix = max((t for t in turns if t.get("suffix_cache_tokens")), key=lambda t: t["suffix_cache_tokens"], default=None)
    run_rss = [t["run_rss_bytes"] for t in turns if t.get("run_rss_bytes") is not None]
    entry.update(
        tokens_per_second=_rate(turns),
        decode_tokens_per_second=_decode_rate(turns),
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
        # The largest suffix cache of the group (one conversation's responses): its size and bytes per token.
        suffix_cache_tokens=suffix["suffix_cache_tokens"] if suffix else None,
        suffix_cache_bytes_per_token=suffix["suffix_cache_bytes"] / suffix["suffix_cache_tokens"] if suffix else None,
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
    weight_bytes: Mapping[str, tuple[int, int]],
    bandwidth: float | None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """``summary[method][category]`` (plus ``"all"``) with every aggregate figure.

    ``weight_bytes[method]`` is (target, draft) bytes read per forward pass, for the ceiling.
    """
    categories = list(dict.fromkeys(r["category"] for r in records))
    # grouped[method][group][prompt_id] = chosen turns, groups being the categories and "all"
    # (prompt ids are unique across categories).
    grouped: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {m: {c: {} for c in categories + [ALL]} for m in methods}
    failures: dict[str, dict[str, int]] = {m: {} for m in methods}
    for record in records:
        method, category = record["method"], record["category"]
        if method not in grouped:
            continue
        if record.get("error") or not record["repeats"]:
            failures[method][category] = failures[method].get(category, 0) + 1
            continue
        turns = chosen_repeat(record)
        grouped[method][category][record["prompt_id"]] = turns
        grouped[method][ALL][record["prompt_id"]] = turns
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for method in methods:
        summary[method] = {}
        reference = equality_reference(method, methods)
        for group, group_runs in grouped[method].items():
            failed = sum(failures[method].values()) if group == ALL else failures[method].get(group, 0)
            entry = aggregate(group_runs, failed, *weight_bytes.get(method, (0, 0)), bandwidth)
            entry.update({key: None for _, key in SPEEDUP_BASELINES + DECODE_BASELINES}, equality=None)
            for baselines, rate in ((SPEEDUP_BASELINES, _rate), (DECODE_BASELINES, _decode_rate)):
                for baseline, key in baselines:
                    if baseline in grouped:
                        entry[key] = _ratio(group_runs, grouped[baseline][group], rate)
            if greedy and reference is not None and group_runs:
                ref_runs = grouped[reference][ALL]
                compared = {p: first_difference(ts, ref_runs[p]) for p, ts in group_runs.items() if p in ref_runs}
                entry["equality"] = {
                    "reference": reference,
                    "prompts_compared": len(compared),
                    "equal_fraction": sum(d is None for d in compared.values()) / len(compared) if compared else None,
                    "first_differences": {p: d for p, d in compared.items() if d is not None},
                }
            summary[method][group] = entry
    return summary

"""The audit's distribution check: seeded sampled draws of a method against the target's exact
distribution over its first few tokens (Pearson's chi-square, ``audit/chi_square.py``), and the
test's power against a sampler that emits the drafter's own tokens unchanged (see
``audit/run.py``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.audit.chi_square import cell_vectors, critical_value, pearson_statistic, pooled_cells, simulated_power
from specdecode.audit.near_tie import near_tie_threshold, verify_shapes
from specdecode.config import TREE_METHODS, SamplingParams
from specdecode.core.sampling import LogitsProcessor

if TYPE_CHECKING:
    from specdecode.api import SpecDecoder
    from specdecode.audit.config import AuditConfig

POWER_RUNS = 1000  # simulated tests behind the reported power
GOOD_POWER = 0.9  # below this the report says the test could not tell a broken sampler apart


@dataclass(slots=True)
class DistributionResult:
    method: str
    draws: int
    statistic: float | None  # Pearson's chi-square of the draws against the target's exact P
    df: int
    critical: float | None  # at p = alpha
    critical_source: str
    verdict: str  # "pass", "FAIL", or "inconclusive" (one cell: nothing to test)
    cells: int
    impossible: int  # draws the target cannot produce (outside its top-k), not near-ties
    boundary_ties: int  # draws outside the top-k by less than the near-tie threshold (excused)
    q_statistic: float | None  # the statistic at the expected counts of the drafter's own Q
    power: float | None  # fraction of simulated runs of Q that the test fails
    power_note: str = ""
    accepted: int = 0  # drafted tokens accepted over all draws: did verification run at all?
    proposed: int = 0

    @property
    def passed(self) -> bool:
        return self.verdict != "FAIL"


def exact_distribution(
    decoder: SpecDecoder, prompt_ids: list[int], processor: LogitsProcessor, length: int
) -> tuple[dict[tuple[int, ...], float], dict[tuple[int, ...], torch.Tensor]]:
    """The target's exact distribution over its next ``length`` sampled tokens, and the logits
    row (V,) after each prefix, by enumeration: one ``target_logits`` call per length, over every
    prefix of that length (the prompt prefilled once per call)."""
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    rows: dict[tuple[int, ...], torch.Tensor] = {}
    for _ in range(length):
        prefixes = list(dist)
        logits = decoder.target_logits(prompt_ids, prefixes)  # (len(prefixes), V)
        grown: dict[tuple[int, ...], float] = {}
        for prefix, row in zip(prefixes, logits):
            rows[prefix] = row
            probs = processor.probs(row)
            for token in torch.nonzero(probs > 0).flatten().tolist():
                grown[prefix + (token,)] = dist[prefix] * probs[token].item()
        dist = grown
    return dist, rows


def drafter_distribution(
    decoder: SpecDecoder,
    method: str,
    prompt_ids: list[int],
    params: SamplingParams,
    outcomes: Iterable[tuple[int, ...]],
    target_rows: dict[tuple[int, ...], torch.Tensor],  # prefix -> the target's logits row (V,)
) -> dict[tuple[int, ...], float] | None:
    """Q: the probability of each outcome if the method emitted its drafter's tokens unchanged,
    the chain of the drafter's first-token distribution after each prefix (a one-hot for a
    deterministic drafter, the target's own row where it proposes nothing: that step decodes
    plainly). None where the method has no single chain drafter (auto, trees, none)."""
    if method not in decoder.drafters or method in TREE_METHODS:
        return None
    processor = LogitsProcessor.from_params(params)
    q_rows: dict[tuple[int, ...], torch.Tensor] = {}
    for prefix, target_row in target_rows.items():
        q_row = decoder.draft_probs(prompt_ids + list(prefix), method, params)
        q_rows[prefix] = processor.probs(target_row) if q_row is None else q_row
    q: dict[tuple[int, ...], float] = {}
    for outcome in outcomes:
        prob = 1.0
        for i, token in enumerate(outcome):
            prob *= q_rows[outcome[:i]][token].item()
        q[outcome] = prob
    return q


def _outside_support_margin(
    decoder: SpecDecoder, prompt_ids: list[int], outcome: tuple[int, ...], processor: LogitsProcessor,
    rows: dict[tuple[int, ...], torch.Tensor],  # prefix -> the target's logits row (V,), where computed
    k: int,
) -> tuple[float, float]:
    """(how far below the top-k cut-off the first unsupported token of ``outcome`` sits, the
    top logit there, which scales the near-tie threshold). The margin is the smallest over the
    pass shapes a verify pass of up to ``k + 1`` rows may have scored the position in (row j of
    r rows): on backends whose kernels round by the rows in a pass, the token at the top-k
    boundary can change with the shape, as the greedy check's reads found."""
    for i, token in enumerate(outcome):
        prefix = outcome[:i]
        row = rows.get(prefix)
        if row is None:
            row = decoder.target_logits(prompt_ids, [prefix])[0]
        if processor.probs(row)[token].item() == 0.0:
            context = list(prompt_ids) + list(prefix)
            reads = [row] + decoder.target_logits_in_passes(context, verify_shapes(k, len(context)))
            margins = [read.topk(processor.top_k).values[-1].item() - read[token].item() for read in reads]
            return min(margins), row.max().item()
    return 0.0, 0.0  # every token supported (cannot happen for an outcome outside ``exact``)


@torch.inference_mode()
def distribution_check(
    decoder: SpecDecoder, prompt_ids: list[int], method: str, config: AuditConfig, progress: Callable[[Iterable], Iterable]
) -> DistributionResult:
    sampling = SamplingParams(temperature=1.0, top_k=config.top_k, top_p=1.0, seed=0)
    processor = LogitsProcessor.from_params(sampling)
    exact, rows = exact_distribution(decoder, prompt_ids, processor, config.sampled_tokens)
    counts: Counter[tuple[int, ...]] = Counter()
    accepted = proposed = 0
    for seed in progress(range(config.seed, config.seed + config.draws)):
        params = SamplingParams(temperature=1.0, top_k=config.top_k, max_new_tokens=config.sampled_tokens,
                                seed=seed, ignore_eos=True)
        result = decoder.generate(prompt_ids, params, method=method, k=config.k)
        counts[tuple(result.token_ids)] += 1
        accepted += result.stats.draft_tokens_accepted
        proposed += result.stats.draft_tokens_proposed

    impossible = ties = 0
    for outcome in [o for o in counts if o not in exact]:
        margin, top = _outside_support_margin(decoder, prompt_ids, outcome, processor, rows, config.k)
        if margin < near_tie_threshold(top, config.precision, config.near_tie):
            ties += counts[outcome]
        else:
            impossible += counts[outcome]

    draws = config.draws
    kept, merge_into = pooled_cells(exact, draws)
    null = cell_vectors(kept, merge_into, exact)  # (cells,)
    observed = cell_vectors(kept, merge_into, {o: c / draws for o, c in counts.items() if o in exact}) * draws
    # Draws outside the support belong to the remainder (cell_vectors put 1 - sum(kept) there).
    df = len(null) - 1
    critical, source = critical_value(df, config.alpha) if df > 0 else (None, "")
    statistic = pearson_statistic(observed, draws * null) if df > 0 else None
    verdict = "FAIL" if impossible else "inconclusive" if df == 0 else "FAIL" if statistic > critical else "pass"

    q = drafter_distribution(decoder, method, prompt_ids, sampling, exact, rows)
    q_statistic = power = None
    if q is not None and df > 0:
        alternative = cell_vectors(kept, merge_into, q)
        q_statistic = pearson_statistic(draws * alternative, draws * null)
        power = simulated_power(alternative, null, draws, critical, POWER_RUNS, config.seed)
    return DistributionResult(
        method, draws, statistic, df, critical, source, verdict, len(null), impossible, ties,
        q_statistic, power, _power_note(method, q is not None, power, accepted, proposed, df), accepted, proposed,
    )


def _power_note(method: str, has_q: bool, power: float | None, accepted: int, proposed: int, df: int) -> str:
    """What the power figure cannot see, in words ("" when nothing needs saying)."""
    if df == 0:
        return "inconclusive: no two outcomes have an expected count >= 5; raise --draws (or --top-k)"
    if method == "none":
        return "plain sampling: nothing is drafted, so this checks the sampler and the exact enumeration only"
    if proposed == 0:
        return "nothing was drafted in these tokens: the test measured plain sampling; try another prompt"
    if accepted == 0:
        # Every draft rejected: typically drafts the target gives probability 0, whose residual is
        # p itself, so a sampler that recovers from p instead of the residual looks the same.
        return "no drafted token was accepted: only rejections ran, and a wrong residual may look right here; try another prompt"
    if not has_q:
        return f"no power estimate: {method} has no single chain drafter (the drafter's Q is undefined)"
    if power is not None and power < GOOD_POWER:
        return "weak: the drafter's own tokens would often pass this test too; try more --draws or another prompt"
    return ""

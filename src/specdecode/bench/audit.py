"""The losslessness audit behind ``specdecode audit``: does a method reproduce the target here,
with these models, on this machine?

Two checks per method, both against the target alone (read through ``decoder.engine.target``,
the ``backends/base.py`` interface, so any backend is audited the same way):

- greedy: each prompt is decoded greedily by the method and by plain decoding, and the two
  outputs are compared token by token. At the first difference the target's logits there
  are recomputed teacher-forced (prompt + plain continuation in one pass). If the two tokens'
  logits are closer than the near-tie threshold, passes of different shapes may round either
  way and neither run is wrong (a near-tie); otherwise the method picked a token the target
  does not rank first: FAIL.
- distribution: ``draws`` seeded generations of the first ``sampled_tokens`` tokens at
  temperature 1 with a small top-k are counted and compared with the target's exact
  distribution over those sequences (enumerated with teacher-forced passes) by Pearson's
  chi-square at p = ``alpha``. A sequence the target cannot produce fails the check unless its
  token sat within the near-tie threshold of the top-k cut-off. The check also reports its
  power: the statistic the same test would measure if the method emitted its drafter's tokens
  unchanged (the draft's chain distribution Q instead of the target's P), and the fraction of
  simulated runs of Q that it would fail. A test without power passes anything; the report says
  so instead of calling that a pass of substance.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdecode.bench.chi_square import cell_vectors, critical_value, pearson_statistic, pooled_cells, simulated_power
from specdecode.config import DEFAULT_K, METHODS, TREE_METHODS, SamplingParams
from specdecode.drafters.base import is_tree_drafter
from specdecode.engine.sampling import LogitsProcessor, make_generator
from specdecode.errors import InvalidRequestError

if TYPE_CHECKING:
    from specdecode.api import SpecDecoder
    from specdecode.backends.base import SequenceModel

DEFAULT_DRAWS = 1500
DEFAULT_SAMPLED_TOKENS = 3  # 3 tokens: a k=2 step exercises acceptance, recovery and the bonus token
DEFAULT_TOP_K = 3  # 3^3 = 27 sequences: enumerable, and most cells keep an expected count >= 5
DEFAULT_ALPHA = 0.001  # a correct sampler fails 1 run in 1,000
POWER_RUNS = 1000  # simulated tests behind the reported power
GOOD_POWER = 0.9  # below this the report says the test could not tell a broken sampler apart
# The distribution prompt is the first prompt's text twice over (no chat template), so that
# prompt lookup has a continuation to copy: on a prompt it cannot match, ngram never drafts
# in a few tokens and the test would measure plain sampling only.
DISTRIBUTION_PROMPT_COPIES = 2

# Near-ties. Plain decoding scores one row per pass and a verify pass k + 1; kernels whose
# rounding depends on the row count move logits a little (tests/helpers.NEAR_TIE: up to ~4e-4
# in fp32). A difference between two tokens whose logits are closer than the threshold is a
# near-tie, not a bug. fp32: an order of magnitude above that measurement. bf16/fp16: the model
# rounds its logits to the dtype, so the noise is a number of units in the last place (ulp) of
# the top logit: one bf16 ulp (0.125 at |logit| in [16, 32)) on the demo target between 1-row,
# 6-row and whole-prompt passes on a 2-core AMD EPYC. Four ulps allow two of rounding on each
# logit of the pair; the fp32 floor applies to every dtype.
NEAR_TIE_FP32 = 5e-3
NEAR_TIE_ULPS = 4
MANTISSA_BITS = {"fp32": 23, "bf16": 7, "fp16": 10}

def ulp(value: float, precision: str) -> float:
    """Spacing of ``precision``'s numbers near ``value`` (the unit in the last place)."""
    exponent = math.floor(math.log2(max(abs(value), 2.0**-14)))
    return 2.0 ** (exponent - MANTISSA_BITS[precision])


def near_tie_threshold(top_logit: float, precision: str, override: float | None = None) -> float:
    """The logit gap below which two greedy choices count as a near-tie (see NEAR_TIE_ULPS)."""
    if override is not None:
        return override
    return max(NEAR_TIE_FP32, NEAR_TIE_ULPS * ulp(top_logit, precision))


def near_tie_rule(precision: str, override: float | None) -> str:
    """The threshold in words, for the report."""
    if override is not None:
        return f"{override:g} (--near-tie)"
    if precision == "fp32":
        return f"{NEAR_TIE_FP32:g}"
    return f"max({NEAR_TIE_FP32:g}, {NEAR_TIE_ULPS} {precision} ulps of the top logit)"


@dataclass(slots=True)
class AuditConfig:
    methods: tuple[str, ...]
    max_new_tokens: int = 64
    draws: int = DEFAULT_DRAWS
    sampled_tokens: int = DEFAULT_SAMPLED_TOKENS
    top_k: int = DEFAULT_TOP_K
    k: int = DEFAULT_K  # tokens drafted per step; the engine caps it at sampled_tokens - 1 when sampling
    seed: int = 0
    alpha: float = DEFAULT_ALPHA
    precision: str = "fp32"  # fp32, bf16 or fp16: what the near-tie threshold scales with
    near_tie: float | None = None  # a fixed threshold instead of the per-precision rule

    def __post_init__(self) -> None:
        if not self.methods:
            raise InvalidRequestError("Give at least one method to audit (--method draft,ngram).")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise InvalidRequestError(f"Unknown method {unknown[0]!r}; choose from: {', '.join(METHODS)}.")
        for name, value, least in (("--draws", self.draws, 1), ("--max-new-tokens", self.max_new_tokens, 1),
                                   ("--sampled-tokens", self.sampled_tokens, 1), ("--top-k", self.top_k, 2),
                                   ("--k", self.k, 1)):
            if value < least:
                raise InvalidRequestError(f"{name} must be >= {least}, got {value}.")
        if not 0.0 < self.alpha < 1.0:
            raise InvalidRequestError(f"--alpha must be in (0, 1), got {self.alpha}.")
        if self.precision not in MANTISSA_BITS:
            raise InvalidRequestError(f"precision must be one of {', '.join(MANTISSA_BITS)}, got {self.precision!r}.")
        if self.near_tie is not None and self.near_tie < 0:
            raise InvalidRequestError(f"--near-tie must be >= 0, got {self.near_tie}.")


@dataclass(slots=True)
class GreedyResult:
    prompt_id: str
    method: str
    verdict: str  # "equal", "near-tie" (differs where the target is tied: not a bug) or "FAIL"
    tokens: int  # plain decoding's output length
    compared: int  # positions equal before the first difference (all of them when equal)
    position: int | None = None  # the first differing position
    plain_token: int | None = None
    method_token: int | None = None
    top2_gap: float | None = None  # the target's top-1 minus top-2 logit there (teacher-forced)
    token_gap: float | None = None  # |logit(plain token) - logit(method token)| there
    threshold: float | None = None  # the near-tie threshold applied there

    @property
    def passed(self) -> bool:
        return self.verdict != "FAIL"


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


@dataclass(slots=True)
class AuditReport:
    target: str
    draft: str | None
    backend: str
    precision: str
    near_tie: str  # the threshold rule, in words
    alpha: float
    config: dict[str, Any]
    greedy: list[GreedyResult] = field(default_factory=list)
    distribution: list[DistributionResult] = field(default_factory=list)
    distribution_prompt: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.greedy) and all(r.passed for r in self.distribution)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        return out


def check_methods(decoder: SpecDecoder, methods: Iterable[str]) -> None:
    """Refuse, before any work, a method this decoder was not loaded for."""
    for method in methods:
        if method == "draft" and decoder.draft is None:
            raise InvalidRequestError("--method draft needs a draft model: pass --draft (same tokenizer as --target).")
        if method in TREE_METHODS and method not in decoder.drafters:
            raise InvalidRequestError(f"--method {method} needs its heads: pass --heads FOLDER from `specdecode train {method}`.")
        if method == "layerskip" and method not in decoder.drafters:
            raise InvalidRequestError("--method layerskip needs the layers to skip: pass --skip-layers or --layerskip-config.")


def _row_logits(seq: SequenceModel, ids: Sequence[int]) -> torch.Tensor:  # -> (V,) float32
    """The target's next-token logits after ``ids``, teacher-forced in one pass."""
    seq.begin(len(ids) + 1)
    tokens = torch.tensor([list(ids)], dtype=torch.long, device=seq.device)
    return seq.extend(tokens, 0, logits_last=1).logits[0, -1].float()


@torch.inference_mode()
def greedy_check(
    decoder: SpecDecoder, prompt_id: str, prompt_ids: list[int], method: str, plain: list[int], config: AuditConfig
) -> GreedyResult:
    params = SamplingParams(max_new_tokens=config.max_new_tokens)
    got = decoder.generate(prompt_ids, params, method=method, k=config.k).token_ids
    position = next((i for i, (a, b) in enumerate(zip(got, plain)) if a != b), None)
    if position is None:
        if len(got) == len(plain):
            return GreedyResult(prompt_id, method, "equal", len(plain), len(plain))
        # Same tokens, different lengths: the same stop rule cannot do that.
        shorter = min(len(got), len(plain))
        return GreedyResult(prompt_id, method, "FAIL", len(plain), shorter, position=shorter)
    logits = _row_logits(decoder.engine.target, prompt_ids + plain[:position])  # (V,)
    top = logits.topk(2).values.tolist()
    token_gap = abs(logits[plain[position]].item() - logits[got[position]].item())
    threshold = near_tie_threshold(top[0], config.precision, config.near_tie)
    return GreedyResult(
        prompt_id, method, "near-tie" if token_gap < threshold else "FAIL", len(plain), position,
        position=position, plain_token=plain[position], method_token=got[position],
        top2_gap=top[0] - top[1], token_gap=token_gap, threshold=threshold,
    )


@torch.inference_mode()
def exact_distribution(
    seq: SequenceModel, prompt_ids: list[int], processor: LogitsProcessor, length: int
) -> tuple[dict[tuple[int, ...], float], dict[tuple[int, ...], torch.Tensor]]:
    """The target's exact distribution over its next ``length`` sampled tokens, and the logits
    row (V,) after each prefix, by enumeration. The prompt is prefilled once; each prefix is one
    pass from the prompt's last token (the backend overwrites the slots past the commit)."""
    prompt_len = len(prompt_ids)
    seq.begin(prompt_len + length + 1)
    device = seq.device
    if prompt_len > 1:
        seq.extend(torch.tensor([prompt_ids[:-1]], device=device), 0, compute_logits=False)
    seq.commit(prompt_len - 1)
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    rows: dict[tuple[int, ...], torch.Tensor] = {}
    for _ in range(length):
        grown: dict[tuple[int, ...], float] = {}
        for prefix, prob in dist.items():
            tokens = torch.tensor([[prompt_ids[-1], *prefix]], device=device)
            rows[prefix] = seq.extend(tokens, prompt_len - 1, logits_last=1).logits[0, -1].float()
            probs = processor.probs(rows[prefix])
            for token in torch.nonzero(probs > 0).flatten().tolist():
                grown[prefix + (token,)] = prob * probs[token].item()
        dist = grown
    return dist, rows


@torch.inference_mode()
def drafter_distribution(
    decoder: SpecDecoder,
    method: str,
    prompt_ids: list[int],
    processor: LogitsProcessor,
    outcomes: Iterable[tuple[int, ...]],
    target_rows: dict[tuple[int, ...], torch.Tensor],  # prefix -> the target's logits row (V,)
) -> dict[tuple[int, ...], float] | None:
    """Q: the probability of each outcome if the method emitted its drafter's tokens unchanged,
    the chain of the drafter's first-token distribution after each prefix (a one-hot for a
    deterministic drafter, the target's own row where it proposes nothing: that step decodes
    plainly). None where the method has no single chain drafter (auto, trees, none)."""
    drafter = decoder.drafters.get(method)
    if drafter is None or is_tree_drafter(drafter):
        return None
    seq = decoder.engine.target
    generator = make_generator(0, seq.device)
    q_rows: dict[tuple[int, ...], torch.Tensor] = {}
    for prefix, target_row in target_rows.items():
        context = prompt_ids + list(prefix)
        capacity = len(context) + 2
        # Set up exactly as the engine does before a step (layer skip drafts in the target's cache).
        seq.begin(capacity)
        drafter.start(len(context), capacity, seq)
        if hasattr(drafter, "on_committed"):
            drafter.on_committed(list(context))
        if len(context) > 1:
            seq.extend(torch.tensor([context[:-1]], device=seq.device), 0, compute_logits=False)
        seq.commit(len(context) - 1)
        proposal = drafter.propose(torch.tensor([context], device=seq.device), 1, processor, generator)
        if proposal.num_tokens == 0:
            q_rows[prefix] = processor.probs(target_row)
        elif proposal.probs is None:
            q_rows[prefix] = torch.zeros_like(target_row).index_fill_(0, proposal.tokens[0, :1], 1.0)
        else:
            q_rows[prefix] = proposal.probs[0, 0].float()
    q: dict[tuple[int, ...], float] = {}
    for outcome in outcomes:
        prob = 1.0
        for i, token in enumerate(outcome):
            prob *= q_rows[outcome[:i]][token].item()
        q[outcome] = prob
    return q


def _outside_support_margin(
    seq: SequenceModel, prompt_ids: list[int], outcome: tuple[int, ...], processor: LogitsProcessor,
    rows: dict[tuple[int, ...], torch.Tensor],  # prefix -> the target's logits row (V,), where computed
) -> tuple[float, float]:
    """(how far below the top-k cut-off the first unsupported token of ``outcome`` sits, the
    top logit there, which scales the near-tie threshold)."""
    for i, token in enumerate(outcome):
        prefix = outcome[:i]
        row = rows.get(prefix)
        if row is None:
            row = _row_logits(seq, prompt_ids + list(prefix))
        if processor.probs(row)[token].item() == 0.0:
            cut = row.topk(processor.top_k).values[-1].item()
            return cut - row[token].item(), row.max().item()
    return 0.0, 0.0  # every token supported (cannot happen for an outcome outside ``exact``)


@torch.inference_mode()
def distribution_check(
    decoder: SpecDecoder, prompt_ids: list[int], method: str, config: AuditConfig, progress: Callable[[Iterable], Iterable]
) -> DistributionResult:
    processor = LogitsProcessor(temperature=1.0, top_k=config.top_k, top_p=1.0)
    seq = decoder.engine.target
    exact, rows = exact_distribution(seq, prompt_ids, processor, config.sampled_tokens)
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
        margin, top = _outside_support_margin(seq, prompt_ids, outcome, processor, rows)
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

    q = drafter_distribution(decoder, method, prompt_ids, processor, exact, rows)
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


def distribution_prompt(decoder: SpecDecoder, text: str) -> list[int]:
    """The distribution check's prompt: ``text`` without the chat template, DISTRIBUTION_PROMPT_COPIES times."""
    return decoder.encode(text, chat=False) * DISTRIBUTION_PROMPT_COPIES


def run_audit(
    decoder: SpecDecoder,
    prompts: Sequence[tuple[str, list[int]]],  # (prompt id, token ids) for the greedy check
    distribution_ids: list[int],
    config: AuditConfig,
    progress: Callable[[Iterable, str], Iterable] = lambda items, label: items,
) -> AuditReport:
    """Both checks for every method in ``config.methods``; nothing printed (see ``progress``)."""
    import time

    started = time.perf_counter()
    check_methods(decoder, config.methods)
    report = AuditReport(
        target=decoder.target.name, draft=None if decoder.draft is None else decoder.draft.name,
        backend=getattr(decoder.engine.target, "backend", "torch"), precision=config.precision,
        near_tie=near_tie_rule(config.precision, config.near_tie), alpha=config.alpha, config=asdict(config),
    )
    params = SamplingParams(max_new_tokens=config.max_new_tokens)
    for prompt_id, ids in progress(prompts, "greedy"):
        plain = decoder.generate(ids, params, method="none").token_ids
        for method in config.methods:
            report.greedy.append(greedy_check(decoder, prompt_id, ids, method, plain, config))
    report.distribution_prompt = decoder.tokenizer.decode(distribution_ids)
    for method in config.methods:
        label = f"sample {method}"
        report.distribution.append(
            distribution_check(decoder, distribution_ids, method, config, lambda items, label=label: progress(items, label))
        )
    report.seconds = time.perf_counter() - started
    return report

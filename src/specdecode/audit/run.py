"""The losslessness audit behind ``specdecode audit``: does a method reproduce the target here,
with these models, on this machine?

Two checks per method, both against the target alone (read through the public
``SpecDecoder.target_logits``, so any backend is audited the same way):

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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdecode.audit.config import DEFAULT_ALPHA, DEFAULT_DRAWS, DEFAULT_SAMPLED_TOKENS, DEFAULT_TOP_K, AuditConfig
from specdecode.audit.distribution import GOOD_POWER, DistributionResult, distribution_check
from specdecode.audit.near_tie import near_tie_rule, near_tie_threshold, verify_shapes
from specdecode.config import SamplingParams
from specdecode.core import registry
from specdecode.errors import InvalidRequestError

if TYPE_CHECKING:
    from specdecode.api import SpecDecoder

# Re-exported: the audit's results and thresholds, read by callers of ``run_audit``.
__all__ = ["DEFAULT_ALPHA", "DEFAULT_DRAWS", "DEFAULT_SAMPLED_TOKENS", "DEFAULT_TOP_K", "GOOD_POWER", "AuditConfig", "AuditReport", "DistributionResult", "GreedyResult", "near_tie_threshold",
           "run_audit"]

# The distribution prompt is the first prompt's text twice over (no chat template), so that
# prompt lookup has a continuation to copy: on a prompt it cannot match, ngram never drafts
# in a few tokens and the test would measure plain sampling only.
DISTRIBUTION_PROMPT_COPIES = 2


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
    # logit(plain token) - logit(method token) there, read with passes of 1, k + 1 and all rows
    # (keys "1", "k+1", "all"): kernels whose rounding depends on the rows in a pass may order
    # the two tokens differently by pass shape, which makes the difference rounding, not a bug.
    pair_gaps: dict[str, float] | None = None

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
        needs = registry.BY_NAME[method].needs if method in registry.BY_NAME else registry.NEEDS_NOTHING
        if needs == registry.NEEDS_DRAFT_MODEL and decoder.draft is None:
            raise InvalidRequestError(f'method="{method}" needs a draft model: pass draft= (same tokenizer as the target).')
        if needs == registry.NEEDS_HEADS and method not in decoder.drafters:
            raise InvalidRequestError(f'method="{method}" needs its heads: pass heads=FOLDER from `specdecode train {method}`.')
        if needs == registry.NEEDS_SKIP_LAYERS and method not in decoder.drafters:
            raise InvalidRequestError(f'method="{method}" needs the layers to skip: pass skip_layers= or layerskip_config=.')


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
    reads = {"all": None, "1": 1, "k+1": config.k + 1}
    rows = {name: decoder.target_logits(prompt_ids, [plain[:position]], rows_per_pass=rows)[0]  # (V,)
            for name, rows in reads.items()}
    # Every shape a verify pass may have scored this position in: row j of a pass over r rows
    # (r up to k + 1). With a cached prompt the first verify pass scores the prompt's last token
    # beside the drafts, a shape none of the reads above has (found on an AVX2 machine, where a
    # 2-row pass ranked the method's first token 0.005 ahead and a 1-row pass 0.2 behind).
    context = list(prompt_ids) + list(plain[:position])
    shapes = verify_shapes(config.k, len(context))
    if position == 0:
        # The first new token comes from the pass that feeds the prompt with the first drafts:
        # the prompt's last row of a pass over the whole prompt and 1..k drafts.
        shapes += [(len(context) + drafts, len(context) - 1) for drafts in range(1, config.k + 1)]
    for (count, row), logits in zip(shapes, decoder.target_logits_in_passes(context, shapes)):
        rows[f"{count}:{row}"] = logits
    pair_gaps = {name: row[plain[position]].item() - row[got[position]].item() for name, row in rows.items()}
    logits = rows["all"]
    top = logits.topk(2).values.tolist()
    token_gap = abs(pair_gaps["all"])
    threshold = near_tie_threshold(top[0], config.precision, config.near_tie)
    return GreedyResult(
        prompt_id, method, near_tie_verdict(pair_gaps, threshold), len(plain), position,
        position=position, plain_token=plain[position], method_token=got[position],
        top2_gap=top[0] - top[1], token_gap=token_gap, threshold=threshold, pair_gaps=pair_gaps,
    )


def near_tie_verdict(pair_gaps: dict[str, float], threshold: float) -> str:
    """"near-tie" where the plain and the method's token are within ``threshold`` in any read,
    or where the target itself orders them differently depending on the rows in a pass (so a
    verify pass may rank the method's token first where one-row decoding does not); "FAIL"
    where every read puts the plain token ahead by more than the threshold."""
    if min(abs(gap) for gap in pair_gaps.values()) < threshold or min(pair_gaps.values()) <= 0:
        return "near-tie"
    return "FAIL"


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
        backend=decoder.backend, precision=config.precision,
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

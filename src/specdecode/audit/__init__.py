"""``specdecode audit``: does a method reproduce the target here, with these models, on this
machine? Greedy equality with the gap at the first difference, and a chi-square test of sampled
draws against the target's exact distribution, with the test's power (``run.py``). It reads the
models through the public ``SpecDecoder`` API only (``generate``, ``target_logits``,
``draft_probs``).

- ``config.py``: what an audit checks (``AuditConfig``);
- ``run.py``: the greedy check, the report, ``run_audit``;
- ``distribution.py``: the chi-square check of sampling and its power;
- ``near_tie.py``: when a difference is rounding, not a bug;
- ``chi_square.py``: the statistics.
"""

from specdecode.audit.config import DEFAULT_ALPHA, DEFAULT_DRAWS, DEFAULT_SAMPLED_TOKENS, DEFAULT_TOP_K, AuditConfig
from specdecode.audit.distribution import GOOD_POWER, DistributionResult
from specdecode.audit.near_tie import near_tie_threshold
from specdecode.audit.run import AuditReport, GreedyResult, distribution_prompt, greedy_check, run_audit

__all__ = ["DEFAULT_ALPHA", "DEFAULT_DRAWS", "DEFAULT_SAMPLED_TOKENS", "DEFAULT_TOP_K", "GOOD_POWER", "AuditConfig",
           "AuditReport", "DistributionResult", "GreedyResult", "distribution_prompt", "greedy_check",
           "near_tie_threshold", "run_audit"]

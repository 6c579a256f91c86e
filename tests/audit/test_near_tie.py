"""The near-tie rule of ``specdecode audit`` (``audit/near_tie.py``)."""

from helpers import NEAR_TIE

from specdecode.audit.near_tie import near_tie_rule, near_tie_threshold


def test_near_tie_threshold_follows_the_precision() -> None:
    assert near_tie_threshold(20.0, "fp32") == NEAR_TIE  # the tests' own fp32 threshold
    assert near_tie_threshold(20.0, "bf16") == 4 * 0.125  # 4 bf16 ulps in [16, 32)
    assert near_tie_threshold(40.0, "bf16") == 4 * 0.25
    assert near_tie_threshold(40.0, "bf16", override=0.01) == 0.01
    assert near_tie_rule("fp32", None) == f"{NEAR_TIE:g}" and "bf16 ulps" in near_tie_rule("bf16", None)

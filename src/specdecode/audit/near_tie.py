"""Near-ties: where two greedy choices may differ by rounding alone, not by a bug.

A method's greedy output that first differs from plain decoding where the target's two tokens
are closer than ``near_tie_threshold`` is excused; anywhere else it is a failure. The target's
logits there are recomputed teacher-forced (``SpecDecoder.target_logits``).
"""

from __future__ import annotations

import math

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


def verify_shapes(k: int, context: int) -> list[tuple[int, int]]:
    """(rows, row) of every verify pass of 2..k + 1 rows that can score the position after
    ``context`` tokens: row j of the pass (the one-row pass is the "1" read)."""
    return [(count, row) for count in range(2, k + 2) for row in range(min(count, context))]

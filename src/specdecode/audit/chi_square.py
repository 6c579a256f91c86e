"""Pearson's chi-square goodness-of-fit test, small enough to carry without scipy.

``specdecode audit`` asks whether sampled sequences follow a distribution it computed exactly.
It needs three things: the statistic over pooled cells, the critical value at a chosen p, and
how often the test would fail a sampler that draws from another distribution (its power).

Critical values come from ``scipy.stats.chi2`` when scipy is installed and otherwise from the
regularised upper incomplete gamma function below (Numerical Recipes' series and continued
fraction, bisected to 1e-9): the same numbers, not an approximation, so the report's verdict
does not depend on what else is installed. The report names which one it used.
"""

from __future__ import annotations

import math

import numpy as np

MIN_EXPECTED = 5.0  # Pearson's approximation wants every expected count >= 5 (Cochran's rule)
_GAMMA_EPS = 1e-14
_GAMMA_MAX_ITER = 10_000
_TINY = 1e-300  # keeps Lentz's continued fraction away from a division by zero
BUILTIN_SOURCE = "built-in incomplete gamma"
SCIPY_SOURCE = "scipy.stats.chi2"


def _log_gamma_prefix(a: float, x: float) -> float:
    return -x + a * math.log(x) - math.lgamma(a)


def _lower_series(a: float, x: float) -> float:
    """P(a, x) by its power series: converges fast for x < a + 1."""
    term = total = 1.0 / a
    denominator = a
    for _ in range(_GAMMA_MAX_ITER):
        denominator += 1.0
        term *= x / denominator
        total += term
        if abs(term) < abs(total) * _GAMMA_EPS:
            break
    return total * math.exp(_log_gamma_prefix(a, x))


def _upper_fraction(a: float, x: float) -> float:
    """Q(a, x) by its continued fraction (modified Lentz): converges fast for x >= a + 1."""
    b = x + 1.0 - a
    c = 1.0 / _TINY
    d = 1.0 / b
    h = d
    for i in range(1, _GAMMA_MAX_ITER):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = d if abs(d) > _TINY else _TINY
        c = b + an / c
        c = c if abs(c) > _TINY else _TINY
        d = 1.0 / d
        step = d * c
        h *= step
        if abs(step - 1.0) < _GAMMA_EPS:
            break
    return h * math.exp(_log_gamma_prefix(a, x))


def chi2_sf(x: float, df: float) -> float:
    """P(X > x) for X ~ chi-square with ``df`` degrees of freedom (df may be fractional)."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    if x <= 0:
        return 1.0
    a, half_x = df / 2.0, x / 2.0
    if half_x < a + 1.0:
        return max(0.0, 1.0 - _lower_series(a, half_x))
    return min(1.0, _upper_fraction(a, half_x))


def builtin_critical_value(df: int, alpha: float) -> float:
    """The x with P(X > x) = alpha, by bisection on ``chi2_sf``."""
    low, high = 0.0, df + 10.0 * math.sqrt(2.0 * df) + 50.0
    while chi2_sf(high, df) > alpha:
        high *= 2.0
    for _ in range(200):
        mid = (low + high) / 2.0
        if chi2_sf(mid, df) > alpha:
            low = mid
        else:
            high = mid
        if high - low < 1e-9:
            break
    return (low + high) / 2.0


def critical_value(df: int, alpha: float) -> tuple[float, str]:
    """(critical value at significance ``alpha``, where it came from)."""
    try:
        from scipy.stats import chi2
    except ImportError:
        return builtin_critical_value(df, alpha), BUILTIN_SOURCE
    return float(chi2.isf(alpha, df)), SCIPY_SOURCE


def pooled_cells(
    expected_probs: dict[tuple[int, ...], float], draws: int
) -> tuple[list[tuple[int, ...]], tuple[int, ...] | None]:
    """Cells for the test: every outcome whose expected count is >= ``MIN_EXPECTED``; the rest
    (and anything outside ``expected_probs``) is one remainder cell.

    Returns (kept outcomes, the kept outcome the remainder merges into, or None when the
    remainder is a cell of its own). A remainder expected below 5 joins the smallest kept cell
    rather than being dropped, so every draw is counted and df = cells - 1 stays exact.
    """
    kept = sorted((s for s, p in expected_probs.items() if p * draws >= MIN_EXPECTED), key=lambda s: -expected_probs[s])
    rest = 1.0 - sum(expected_probs[s] for s in kept)
    if rest * draws >= MIN_EXPECTED or not kept:
        return kept, None
    return kept, kept[-1]


def cell_vectors(
    kept: list[tuple[int, ...]],
    merge_into: tuple[int, ...] | None,
    probs: dict[tuple[int, ...], float],
) -> np.ndarray:  # (cells,) float64: the probability of each pooled cell under ``probs``
    """``probs`` (any distribution over outcomes) folded into the cells ``pooled_cells`` chose."""
    values = [probs.get(s, 0.0) for s in kept]
    rest = max(0.0, 1.0 - sum(values))
    if merge_into is None:
        values.append(rest)
    else:
        values[kept.index(merge_into)] += rest
    return np.asarray(values, dtype=np.float64)


def pearson_statistic(observed: np.ndarray, expected: np.ndarray) -> float:  # both (cells,)
    """sum (O - E)^2 / E over cells with E > 0."""
    mask = expected > 0
    return float((((observed - expected) ** 2)[mask] / expected[mask]).sum())


def simulated_power(
    alternative: np.ndarray,  # (cells,) the sampler's cell probabilities
    null: np.ndarray,  # (cells,) the target's cell probabilities
    draws: int,
    critical: float,
    runs: int,
    seed: int,
) -> float:
    """Fraction of ``runs`` simulated tests of ``draws`` draws from ``alternative`` that fail.

    Simulated rather than read off the noncentral chi-square: that approximation only holds
    for alternatives close to the null, and a draft far from the target is the usual case.
    """
    rng = np.random.default_rng(seed)
    alternative = np.clip(alternative, 0.0, None)
    counts = rng.multinomial(draws, alternative / alternative.sum(), size=runs)  # (runs, cells)
    expected = draws * null
    mask = expected > 0
    stats = (((counts - expected) ** 2)[:, mask] / expected[mask]).sum(axis=1)
    return float((stats > critical).mean())


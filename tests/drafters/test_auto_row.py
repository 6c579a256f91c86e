"""AutoRow's pricing of its lookups (drafters/auto_row.py): a suffix chain below a long match,
right after an agreement, is priced at its calibrated per-token probability where that is above
the agreement rate; a short match or one after a miss keeps the agreement rate."""

from __future__ import annotations

import random

import pytest

from specdecode.drafters.auto import AFTER_AGREEMENT, AFTER_MISS
from specdecode.drafters.auto_row import LONG_MATCH, AutoRow
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter, SuffixProposer
from specdecode.drafters.suffix_cache import DEFAULT_GROUP, SuffixCache

VERIFY = [0.040 + 0.012 * rows for rows in range(64)]  # index r - 1: a pass over r rows


def _row(prompt: list[int]) -> AutoRow:
    suffix = SuffixDrafter(SuffixProposer(SuffixCache(), DEFAULT_GROUP, depth=32, verify_seconds=VERIFY))
    row = AutoRow(NgramDrafter(4, 2), suffix, ngram_cap=8)
    row.start(len(prompt), len(prompt) + 200)
    row.extend(prompt)
    return row


def _suffix_option(row: AutoRow):
    choices = row.choices(100, None)
    return choices.options[row._labels.index("suffix")]


def _plain_steps(row: AutoRow, tokens: list[int]) -> None:
    """Plain steps emitting ``tokens`` one by one, each scoring the offers made before it."""
    for token in tokens:
        row.choices(100, None)
        row.choose(None)
        row.extend([token])


@pytest.fixture
def text() -> list[int]:
    rng = random.Random(3)
    return [rng.randrange(100, 5000) for _ in range(80)]


def test_a_long_match_after_an_agreement_is_priced_by_its_chain(text: list[int]) -> None:
    row = _row(text + [1, 2])
    _plain_steps(row, text[: LONG_MATCH + 2])  # the answer starts copying the prompt
    agreement = row.agreement["suffix"]
    assert agreement.state == AFTER_AGREEMENT and row._chain.match_len >= LONG_MATCH
    option = _suffix_option(row)
    calibrated = row.suffix.proposer.calibrated(row._chain)
    assert option.acceptance == pytest.approx(calibrated[-1] ** (1 / len(calibrated)))
    assert option.acceptance > agreement.rate  # the per-request rate is still near its prior


def test_a_short_match_or_a_miss_keeps_the_agreement_rate(text: list[int]) -> None:
    row = _row(text + [1, 2])
    _plain_steps(row, text[:3])  # a match of 3 tokens: its counts say little
    assert row.agreement["suffix"].state == AFTER_AGREEMENT
    option = _suffix_option(row)
    assert row._chain.match_len < LONG_MATCH
    assert option.acceptance == row.agreement["suffix"].rate

    row = _row(text + [1, 2])
    _plain_steps(row, text[: LONG_MATCH + 2])
    row.agreement["suffix"].state = AFTER_MISS  # the same long match, its last offer missed
    option = _suffix_option(row)
    assert row._chain.match_len >= LONG_MATCH
    assert option.acceptance == row.agreement["suffix"].rate
    assert option.acceptance < row.suffix.proposer.calibrated(row._chain)[-1] ** (1 / len(row._chain.tokens))

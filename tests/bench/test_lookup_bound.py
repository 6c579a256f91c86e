"""benchmarks/lookup_bound.py: the copy runs a lookup bound is made of, llama.cpp's ngram-mod
replayed, and the bound below every policy it is compared with (no model: token ids and a cost
table written here)."""

from __future__ import annotations

import importlib.util
import random
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import pytest

from specdecode.bench.oracle import CostTable
from specdecode.drafters.suffix_cache import SuffixCache

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def lookup_bound() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))  # the script imports auto_policy_sim beside it
    try:
        spec = importlib.util.spec_from_file_location("lookup_bound", BENCHMARKS / "lookup_bound.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def _costs() -> CostTable:
    # A fixed cost per pass and a cost per row, as measured passes roughly are.
    return CostTable(tuple(0.040 + 0.012 * (rows - 1) for rows in range(1, 200)))


def test_copy_runs_are_the_longest_seen_continuations(lookup_bound: ModuleType) -> None:
    context, y = [1, 2, 3, 4, 5], [2, 3, 9, 2, 3, 9, 7]
    # i=3: "2 3 9" starts at y[0] and ends where the text seen so far ends; i=5: "9" then 2 != 7.
    assert lookup_bound.copy_runs(context, y, cap=8) == [2, 1, 0, 3, 2, 1, 0]
    assert lookup_bound.copy_runs(context, y, cap=2) == [2, 1, 0, 2, 2, 1, 0]
    assert lookup_bound.copy_runs([], [5, 5, 5, 5], cap=8) == [0, 1, 2, 1]


def test_ngram_mod_drafts_long_chains_only(lookup_bound: ModuleType) -> None:
    rng = random.Random(0)
    text = [rng.randrange(1000, 30000) for _ in range(200)]
    ngram_mod = lookup_bound.NgramMod()
    # The answer repeats the prompt: no 24 tokens match until 24 of it are out, then each draft
    # is the 64 tokens that followed, accepted but for what runs past the answer's end.
    seconds = ngram_mod.seconds(text, text, _costs())
    assert ngram_mod.drafts[:2] == [(64, 64), (64, 64)]
    assert all(drafted >= 48 for drafted, _ in ngram_mod.drafts)
    assert seconds < _costs().target(1) * (len(text) - 1) / 2
    # New text: nothing to chain, plain steps only.
    fresh = lookup_bound.NgramMod()
    other = [rng.randrange(1000, 30000) for _ in range(120)]
    assert fresh.seconds(text, other, _costs()) == pytest.approx(_costs().target(1) * (len(other) - 1))
    assert fresh.drafts == []


def test_bound_is_below_plain_auto_and_ngram_mod(lookup_bound: ModuleType) -> None:
    rng = random.Random(1)
    words = [rng.randrange(1000, 30000) for _ in range(150)]
    prompt = words + [7, 8]
    # A near copy of the prompt with two edits, then new text.
    y = words[:60] + [11] + words[61:120] + [12, 13] + words[122:] + [rng.randrange(1000, 30000) for _ in range(40)]
    costs = _costs()
    bound = lookup_bound.bound_seconds(None, prompt, y, costs, cap=128, with_draft=False)
    auto = lookup_bound.simulate_turn_batch(prompt, y, costs, SuffixCache(), defaultdict(int))
    ngram_mod = lookup_bound.NgramMod().seconds(prompt, y, costs)
    plain = costs.target(1) * (len(y) - 1)
    assert bound <= auto and bound <= ngram_mod
    assert bound < plain / 2  # most of y is copied: the bound drafts it

"""benchmarks/priced_sessions.py: sessions decoded for real, every traced pass priced by one
table. Plain decoding is priced at exactly one one-row pass a token after the first; the
later-turn rate leaves each session's first turn out; a given table is interpolated. Tiny F32
GGUF target on llama.cpp."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers import PROMPTS, llamacpp_decoder

from specdecode import SamplingParams
from specdecode.bench.oracle import CostTable

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def priced_sessions() -> ModuleType:
    spec = importlib.util.spec_from_file_location("priced_sessions", BENCHMARKS / "priced_sessions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_sessions_are_priced_by_the_table(priced_sessions: ModuleType, tiny_ggufs: dict[str, Path]) -> None:
    pytest.importorskip("llama_cpp")
    dec = llamacpp_decoder(tiny_ggufs["target"], None)
    first = dec.encode(PROMPTS[0] + " " + PROMPTS[2])
    answer = dec.generate(first, SamplingParams(max_new_tokens=24), method="none").token_ids
    # The second turn holds the first and its answer twice: something for suffix decoding to draft.
    second = first + answer + first + answer + first
    sessions = [[first, second]]
    costs = CostTable(tuple(0.040 + 0.012 * (rows - 1) for rows in range(1, 200)))
    plain = priced_sessions.run_sessions(dec, sessions, "none", 24)
    assert [(r.session, r.turn) for r in plain] == [(0, 0), (0, 1)]
    for turn in plain:
        assert priced_sessions.price_trace(turn.trace, costs) == pytest.approx(costs.target(1) * (turn.tokens - 1))
    assert priced_sessions.later_turn_rates(plain, costs)[0] == pytest.approx(1 / costs.target(1))
    # A drafting method: the later-turn rate is the second turn's alone, priced pass by pass.
    suffix = priced_sessions.run_sessions(dec, sessions, "suffix", 24)
    priced, measured = priced_sessions.later_turn_rates(suffix, costs)
    assert priced == pytest.approx((suffix[1].tokens - 1) / priced_sessions.price_trace(suffix[1].trace, costs))
    assert measured == pytest.approx((suffix[1].tokens - 1) / suffix[1].measured_seconds) and measured > 0
    table = priced_sessions.cost_table(dec, 8, "1:10,4:40")
    assert table.target(2) == pytest.approx(0.020) and table.target(8) == pytest.approx(0.080)

"""The draft-length schedules: the k chooser on synthetic costs, the threshold rule, and that
an adaptive k never changes the output."""

import itertools
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, decoder, plain_tokens

import specdecode.costs.decoder_costs
from specdecode import SamplingParams
from specdecode.config import resolve_k
from specdecode.costs.k_policy import (
    DROP_BELOW,
    PROBE_AFTER,
    PROBE_K,
    AcceptanceEstimate,
    CostAwareK,
    LiveVerifyCosts,
    ThresholdK,
    best_k,
    expected_tokens,
    speculation_can_pay,
)
from specdecode.errors import InvalidRequestError

# A bandwidth-bound CPU: a verify pass over r rows costs 1 + 0.1 (r - 1) units.
FLAT_VERIFY = [1.0 + 0.1 * r for r in range(9)]


def test_expected_tokens_formula() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0


def test_best_k_follows_acceptance_and_costs() -> None:
    # Free drafts and near-certain acceptance: draft as far as allowed.
    assert best_k(0.99, FLAT_VERIFY, 0.0, k_max=8) == 8
    # Nothing is ever accepted: plain decoding.
    assert best_k(0.0, FLAT_VERIFY, 0.05, k_max=8) == 0
    # A draft pass as costly as the target's: speculation cannot pay even at 90% acceptance.
    assert best_k(0.9, FLAT_VERIFY, 1.0, k_max=8) == 0
    # The demo pair's ratio (draft pass ~0.35 of a target pass): by hand, at a = 0.8 the rate
    # E(k) / (0.35 k + 1 + 0.1 k) is 1.000, 1.241, 1.284, 1.256 for k = 0..3, so k = 2; at
    # a = 0.9 it is 1.463 for k = 3 and 4 (k = 3 by a hair: 1.4634 vs 1.4627).
    assert best_k(0.8, FLAT_VERIFY, 0.35, k_max=8) == 2
    assert best_k(0.9, FLAT_VERIFY, 0.35, k_max=8) == 3
    # The chooser respects k_max and the table's length.
    assert best_k(0.99, FLAT_VERIFY, 0.0, k_max=2) == 2
    assert best_k(0.99, FLAT_VERIFY[:4], 0.0, k_max=8) == 3


def test_best_k_plain_when_multi_row_verify_is_expensive() -> None:
    # int4 on this CPU: 6 rows cost 3x one row. At 60% acceptance only k = 1 still pays
    # (rate 1.096 against 1.0 plain and 0.98 for k = 2).
    steep = [1.0, 1.16, 1.4, 1.7, 2.4, 3.0, 3.1, 3.2, 3.3]
    assert best_k(0.6, steep, 0.3, k_max=8) == 1


def test_acceptance_estimate_counts_tried_positions() -> None:
    estimate = AcceptanceEstimate(decay=1.0)
    estimate.observe(proposed=5, accepted=2)  # positions 1, 2 accepted, 3 rejected: 3 tried
    estimate.observe(proposed=4, accepted=4)  # all 4 tried and accepted
    assert (estimate.trials, estimate.accepted) == (7, 6)
    estimate.observe(proposed=0, accepted=0)  # a plain step says nothing about acceptance
    assert estimate.trials == 7
    assert 6 / 7 > estimate.rate > 0.6  # pulled slightly towards the prior


def test_cost_aware_schedule_drops_to_plain_and_probes_again() -> None:
    schedule = CostAwareK(list(FLAT_VERIFY), k_max=8, first_k=5)
    assert schedule.next_k() == 5  # nothing measured yet
    schedule.observe(5, 0, draft_seconds=10.0, draft_passes=5, verify_seconds=1.5)  # includes the draft's prefill
    assert schedule.draft_pass_seconds is None
    for _ in range(6):
        k = schedule.next_k()
        schedule.observe(k, 0, draft_seconds=0.3 * k, draft_passes=k, verify_seconds=FLAT_VERIFY[k])
    assert schedule.next_k() == 0  # every draft rejected: plain steps
    for _ in range(PROBE_AFTER):
        schedule.observe(0, 0, 0.0, 0, FLAT_VERIFY[0])
    assert schedule.next_k() == PROBE_K  # after a run of plain steps it tries again
    for _ in range(8):
        schedule.observe(PROBE_K, PROBE_K, 0.3 * PROBE_K, PROBE_K, FLAT_VERIFY[PROBE_K])
    assert schedule.next_k() >= 3  # acceptance came back: longer drafts


def test_threshold_rule() -> None:
    schedule = ThresholdK(k=5, k_min=1, k_max=7)
    for _ in range(10):
        schedule.observe(schedule.next_k(), schedule.next_k(), 0.1, 1, 1.0)
    assert schedule.next_k() == 7  # raised above 80% acceptance, capped at k_max
    while schedule.acceptance.rate >= DROP_BELOW:
        schedule.observe(schedule.next_k(), 0, 0.1, 1, 1.0)
    assert schedule.next_k() == 1  # dropped to the minimum below 40%


@pytest.mark.parametrize("policy", ["cost", "threshold"])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_adaptive_k_keeps_greedy_output(
    policy: str, method: str, tiny_qwen2_dir: Path, tiny_close_draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tiny draft is as large as the tiny target, so on measured costs it cannot pay and the
    # cost policy would never draft with it (speculation_can_pay); here drafting must be
    # exercised, so the check is waived: the output must stay plain decoding's whatever k is.
    # The waiver is the single-request engine's (its CostAwareK and ThresholdK); on the batch
    # engine such a row drafts only when a re-try of the priced-out draft model falls due, which
    # depends on timing (CI once saw none in these 4 x 24 tokens). The batch engine's policies:
    # tests/engine/test_batch_k_policy.py.
    monkeypatch.setattr(specdecode.costs.decoder_costs, "speculation_can_pay", lambda *args: True)
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir, engine="single")
    proposed = 0
    for prompt in PROMPTS[:4]:
        result = dec.generate(prompt, SamplingParams(max_new_tokens=24), method=method, k="auto", k_policy=policy)
        assert result.token_ids == plain_tokens(tiny_qwen2_dir, prompt), prompt
        proposed += result.stats.draft_tokens_proposed
    if method == "draft":
        assert proposed > 0


def test_verify_costs_are_measured_once(tiny_qwen2_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, None, method="none")
    costs = dec.engine.verify_costs(9)
    assert len(costs) == 9 and all(c > 0 for c in costs)
    assert dec.engine.verify_costs(9) == costs  # cached: no second measurement


def test_verify_cost_tables_share_their_timings() -> None:
    # A 9-row table, then a 33-row one (suffix decoding's): the second times only the probes the
    # first did not, and both read the same timing for the same row count. Interpolated rows lie
    # between their probes' costs, and the probes are dense enough that 5-8 rows are not a line
    # drawn from 4 rows to 17 (a step in the cost, as ggml's kernels have, stays visible).
    from specdecode.engine.single import SpecEngine

    class Steps:  # a pass's cost steps up at 5 rows and again at 9
        device = torch.device("cpu")

        def __init__(self) -> None:
            self.timed: list[int] = []

        def pass_seconds(self, rows: list[int], repeats: int) -> dict[int, float]:
            self.timed += rows
            return {r: 1.0 if r <= 4 else 2.5 if r <= 8 else 3.0 + 0.05 * r for r in rows}

    target = Steps()
    engine = SpecEngine(target, [0])  # type: ignore[arg-type]
    small = engine.verify_costs(9)
    first = list(target.timed)
    large = engine.verify_costs(33)
    assert large[:8] == small[:8] and not set(first) & set(target.timed[len(first):])
    assert len(large) == 33 and all(a <= b for a, b in itertools.pairwise(large))
    assert large[5] == 2.5 and large[7] == 2.5  # 6 and 8 rows: timed, not a line from 4 to 17 rows


def test_k_arguments() -> None:
    assert resolve_k("auto", None) == (None, "cost")
    assert resolve_k("auto", "threshold") == (None, "threshold")
    assert resolve_k(4, None) == (4, None)
    with pytest.raises(InvalidRequestError, match="positive integer or 'auto'"):
        resolve_k("many", None)


def test_cli_accepts_k_auto_and_rejects_bad_values(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path, capsys) -> None:
    from specdecode import cli

    base = ["generate", "--target", str(tiny_qwen2_dir), "--draft", str(tiny_close_draft_dir), "--dtype", "fp32",
            "--device", "cpu", "--max-new-tokens", "6", "--quiet", "--json", "def f():"]
    assert cli.main(base + ["--k", "auto", "--k-policy", "threshold", "--k-max", "4"]) == 0
    assert '"token_ids"' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(base + ["--k", "lots"])
    with pytest.raises(SystemExit):
        cli.main(base + ["--k", "auto", "--k-policy", "sometimes"])


def test_speculation_can_pay_only_where_a_verify_row_is_cheaper_than_a_token() -> None:
    compute_bound = [float(rows) for rows in range(1, 10)]  # every verify row costs a whole pass
    bandwidth_bound = [1.0 + 0.05 * rows for rows in range(9)]  # extra rows nearly free
    assert not speculation_can_pay(compute_bound, 0.5, 8)  # k tokens cost k * 1.5 passes: never
    assert speculation_can_pay(compute_bound, 0.0, 8) is False  # ties at full acceptance: no gain
    assert speculation_can_pay(bandwidth_bound, 0.5, 8)


@pytest.mark.parametrize(("verify", "probes"), [([float(r) for r in range(1, 10)], False),
                                                 ([1.0 + 0.05 * r for r in range(9)], True)])
def test_cost_aware_k_probes_only_where_speculation_can_pay(verify: list[float], probes: bool) -> None:
    schedule = CostAwareK(list(verify), k_max=8, first_k=2, live_costs=False)
    schedule.observe(2, 0, 0.5, 2, 1.0)  # the first step: its draft time holds the draft's prefill
    schedule.observe(2, 0, 1.0, 2, 1.0)  # a draft pass costs 0.5 of a target pass
    for _ in range(PROBE_AFTER):
        schedule.observe(0, 0, 0.0, 0, 1.0)  # a run of plain steps
    assert schedule.next_k() == (PROBE_K if probes else 0)


def test_live_steps_scale_the_whole_cost_table_keeping_its_shape() -> None:
    start = [1.0, 1.96, 2.42, 2.88]  # llama.cpp on 2 cores: a second row costs almost a pass
    schedule = CostAwareK(list(start), k_max=3, first_k=2)
    schedule.observe(1, 1, 0.1, 1, 2 * 1.96)  # a 2-row pass took twice its start-up time
    scale = 0.8 + 0.2 * 2  # blended with COST_DECAY
    assert schedule.verify_seconds == pytest.approx([s * scale for s in start])
    for _ in range(50):  # plain steps, each 10% over the start-up time of one row
        schedule.observe(0, 0, 0.0, 0, 1.1)
    # One row ran 50 times and the others never: their ratios to it are still the start-up ones
    # (blending each row count on its own had made one row 1.1 and left the others at start-up).
    assert [c / schedule.verify_seconds[0] for c in schedule.verify_seconds] == pytest.approx(start)
    assert schedule.verify_seconds[0] == pytest.approx(1.1, rel=1e-3)


def test_live_costs_ignore_what_the_table_cannot_price() -> None:
    costs = LiveVerifyCosts(table := [1.0, 2.0])
    costs.observe(3, 9.0)  # a pass over more rows than the table holds
    costs.observe(1, 0.0)  # a step that was not timed
    assert table == [1.0, 2.0] and costs.scale == 1.0
    frozen = CostAwareK([1.0, 2.0], k_max=1, first_k=1, live_costs=False)  # asynchronous timings
    frozen.observe(1, 1, 0.1, 1, 8.0)
    assert frozen.verify_seconds == [1.0, 2.0]


def test_cost_aware_k_waits_twice_as_long_after_each_probe_that_fails() -> None:
    # Extra verify rows nearly free (speculation can pay), but every drafted token is rejected.
    schedule = CostAwareK([1.0 + 0.05 * rows for rows in range(9)], k_max=8, first_k=2, live_costs=False)
    schedule.observe(2, 0, 1.0, 2, 1.0)
    schedule.observe(2, 0, 1.0, 2, 1.0)  # a draft pass costs 0.5; at this acceptance plain pays best
    waits = []
    for _ in range(3):
        plain = 0
        while (k := schedule.next_k()) == 0:
            schedule.observe(0, 0, 0.0, 0, 1.0)
            plain += 1
        assert k == PROBE_K
        schedule.observe(k, 0, 0.5 * k, k, 1.1)  # the probe: rejected
        waits.append(plain)
    assert waits == [PROBE_AFTER, 2 * PROBE_AFTER, 4 * PROBE_AFTER]
    # A probe whose drafts are accepted brings speculation back and the usual wait.
    while schedule.next_k() == 0:
        schedule.observe(0, 0, 0.0, 0, 1.0)
    for _ in range(6):
        schedule.observe(PROBE_K, PROBE_K, 0.5 * PROBE_K, PROBE_K, 1.1)
    assert schedule.probe_after == PROBE_AFTER and schedule.next_k() > 0


@pytest.mark.parametrize(("verify", "drafts"), [([float(r) for r in range(1, 10)], False),
                                                ([1.0 + 0.05 * r for r in range(9)], True)])
def test_prompt_lookup_is_priced_from_its_first_step(verify: list[float], drafts: bool) -> None:
    # A lookup costs no model pass, so its first match is priced at the prior acceptance: where
    # a verify row costs a whole pass (llama.cpp on 2 cores) it starts plain (and probes later),
    # where rows are nearly free it drafts; a draft model's schedule drafts its k until timed.
    from types import SimpleNamespace

    engine = SimpleNamespace(verify_costs=lambda rows: verify[:rows], device=SimpleNamespace(type="cpu"))
    costs = specdecode.costs.decoder_costs.DecoderCosts(engine, None)  # type: ignore[arg-type]
    lookup = costs.schedule("cost", 5, 8, with_draft_model=False, model_free=True)
    assert lookup is not None and (lookup.next_k() > 0) == drafts
    layer_skip = costs.schedule("cost", 5, 8, with_draft_model=False)  # model passes, not yet timed
    assert layer_skip is not None and layer_skip.next_k() == 5


def test_measured_costs_are_stored_and_read_back_by_the_next_decoder(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path,
                                                                     tmp_path: Path, monkeypatch) -> None:
    """A second decoder over the same files reads the first one's timings instead of timing
    again (costs/store.py); retime_costs=True times again; another model file is another key."""
    import specdecode.costs.store
    from specdecode import SpecDecoder
    from specdecode.core.paths import CACHE_ENV_VAR

    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    # Read back as stored however busy the machine is between the loads: the first decoder's
    # timings are given (a busy machine's are out of order and not stored) and no stored table is
    # spot-checked against the machine (both are tested in test_stored_costs_trust.py).
    monkeypatch.setattr(specdecode.costs.store, "one_row_probe", lambda *args: None)

    def load(**options) -> SpecDecoder:
        return SpecDecoder.from_pretrained(str(tiny_qwen2_dir), str(tiny_close_draft_dir), dtype="fp32", device="cpu",
                                           show_progress=False, **options)

    first = load()
    for seq in (first.engine.target, first.drafters["draft"].model):
        monkeypatch.setattr(seq, "pass_seconds", lambda rows, *a, **k: {r: 0.01 * (1 + 0.1 * r) for r in rows})
    table = first.engine.verify_costs(9)
    draft_costs = first.costs.draft_model()
    second = load()
    calls: list[list[int]] = []
    for seq in (second.engine.target, second.drafters["draft"].model):
        monkeypatch.setattr(seq, "pass_seconds", lambda rows, *a, **k: calls.append(list(rows)) or dict.fromkeys(rows, 1.0))
    assert second.engine.verify_costs(9) == table and second.costs.draft_model() == draft_costs and not calls
    retimed = load(retime_costs=True)
    monkeypatch.setattr(retimed.engine.target, "pass_seconds", lambda rows, *a, **k: calls.append(list(rows)) or
                        dict.fromkeys(rows, 1.0))
    assert retimed.engine.verify_costs(9) == [1.0] * 9 and calls
    other = SpecDecoder.from_pretrained(str(tiny_close_draft_dir), method="none", dtype="fp32", device="cpu",
                                        show_progress=False)
    assert other.engine.cost_store.path != first.engine.cost_store.path

"""How the batch prices a row that picks its source every step (method auto: ``RowChoices`` in
costs/batch_k.py), on hand-made pass costs: what it drafts, from which option, and when it
decodes plainly or is probed."""

from specdecode.costs.batch_k import PROBE_K, BatchK, BatchRow, PassCosts, RowChoices, model_can_pay


def flat() -> PassCosts:
    """A GPU-like verify pass: extra rows nearly free."""
    return PassCosts({1: 1.0, 16: 1.1})


def steep() -> PassCosts:
    """A CPU-like verify pass: each row costs 30% of a pass."""
    return PassCosts({1: 1.0, 2: 1.3, 3: 1.6, 16: 5.5})


def test_a_sure_lookup_drafts_all_it_found_and_a_doubtful_one_decodes_plainly() -> None:
    sure = RowChoices((BatchRow(0.9, 6, uses_draft_model=False),))
    chooser = BatchK(8, flat())
    k = chooser.choose([sure], 1)
    assert k >= 6 and chooser.pick(sure, k, 1).index == 0 and chooser.pick(sure, k, 1).k == 6
    doubtful = RowChoices((BatchRow(0.15, 6, uses_draft_model=False),))
    costly = BatchK(8, steep())
    assert costly.choose([doubtful], 1) == 0 and costly.pick(doubtful, 0, 1).option is None


def test_a_long_sure_lookup_drafts_past_k_max_and_fixed_rows_keep_their_cap() -> None:
    """An auto row's suffix chain may offer more than k_max tokens (as on the single path): the
    batch's k follows it, while a fixed row beside it still drafts at most its own cap."""
    long_chain = RowChoices((BatchRow(0.95, 20, uses_draft_model=False),))
    fixed = BatchRow(0.95, 4, uses_draft_model=False)
    chooser = BatchK(8, flat())
    k = chooser.choose([long_chain, fixed], 2)
    assert k == 20 and chooser.pick(long_chain, k, 2).k == 20
    assert min(k, fixed.cap) == 4


def test_a_row_takes_the_draft_model_only_where_its_passes_pay() -> None:
    """A lookup offering 3 tokens and the draft model offering 5, both at 80%: a cheap draft pass
    makes the model's longer draft the better buy, a pass as dear as the target's does not."""
    row = RowChoices((BatchRow(0.8, 3, uses_draft_model=False), BatchRow(0.8, 5, uses_draft_model=True)))
    cheap = BatchK(8, flat(), PassCosts({1: 0.01, 16: 0.16}))
    k = cheap.choose([row], 1)
    assert cheap.model_allowed and cheap.pick(row, k, 1).index == 1 and cheap.pick(row, k, 1).k == 5
    dear = BatchK(8, flat(), PassCosts({1: 1.0, 16: 16.0}))
    k = dear.choose([row], 1)
    assert k >= 3 and not dear.model_allowed and dear.pick(row, k, 1).index == 0


def test_lookups_need_no_probes_but_a_fixed_row_gets_one() -> None:
    """After many plain steps a fixed row is probed (its estimate is only refreshed by drafting);
    a lookup's agreement is scored on plain steps too, so its row is not."""
    lookup = RowChoices((BatchRow(0.15, 4, uses_draft_model=False),))
    chooser = BatchK(8, steep(), plain_streak=100)
    assert chooser.choose([lookup], 1) == 0 and not chooser.probing
    fixed = BatchK(8, steep(), plain_streak=100)
    assert fixed.choose([BatchRow(0.15, 4, uses_draft_model=False)], 1) == PROBE_K and fixed.probing


def test_the_draft_model_can_pay_only_where_one_row_at_full_acceptance_beats_plain() -> None:
    dear_draft, cheap_draft = PassCosts({1: 1.0, 16: 16.0}), PassCosts({1: 0.01, 16: 0.16})
    assert not model_can_pay(steep(), dear_draft, 8) and model_can_pay(flat(), cheap_draft, 8)
    assert model_can_pay(None, None, 8)  # untimed: nothing says it cannot


def test_a_flat_batch_prices_a_row_by_its_own_drafts() -> None:
    """Four rows, one with a sure lookup. Padded (torch), its 4 drafts widen every row to 5
    tokens (20 computed) and plain decoding wins; flat (llama.cpp's one micro-batch), they add
    4 tokens to the other rows' 4 (8 in all) and pay."""
    table = {1: 1.0, 4: 1.1, 8: 1.5, 16: 3.0, 32: 6.0}
    padded, flat = PassCosts(table), PassCosts(table, flat=True)
    assert padded.pass_seconds([5, 1, 1, 1]) == padded.seconds(4, 5) == padded.prior(20)
    assert flat.pass_seconds([5, 1, 1, 1]) == flat.prior(8) == 1.5
    row = RowChoices((BatchRow(0.9, 6, uses_draft_model=False),))
    assert BatchK(8, padded).choose([row], 4) == 0
    chooser = BatchK(8, flat)
    k = chooser.choose([row], 4)
    assert k > 0 and chooser.pick(row, k, 4).k == k
    # A ragged flat pass teaches the scale only; rows of one width keep their shape's timing.
    flat.observe_pass([5, 1, 1, 1], 3.0)
    assert flat.scale > 1.0 and (4, 5) not in flat.shapes
    flat.observe_pass([2, 2], 0.5)
    assert flat.shapes[(2, 2)] == 0.5 and flat.pass_seconds([2, 2]) == 0.5


def test_layer_skip_drafts_are_priced_as_passes_of_the_kept_layers() -> None:
    """Two layer-skip rows at 70% on flat verify costs (a GPU's): drafting is nearly free when a
    draft pass keeps a tenth of the layers, and never pays when it keeps nine tenths (each
    drafted token then costs most of a target pass: plain decoding wins)."""
    def rows(fraction: float) -> list[BatchRow]:
        return [BatchRow(0.7, 8, uses_draft_model=False, self_pass_fraction=fraction)] * 2

    light = BatchK(8, flat())
    assert light.choose(rows(0.1), 2) >= 2
    heavy = BatchK(8, flat())
    assert heavy.choose(rows(0.9), 2) == 0
    free = BatchK(8, flat())  # before: priced as free as a lookup, it drafted the same rows deep
    assert free.choose(rows(0.0), 2) >= 4

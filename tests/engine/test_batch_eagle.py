"""EAGLE rows of a batch step draft together (drafters/batch_eagle.py):

- a step with 3 EAGLE rows runs as many head passes as a step with 1 (one catch-up, then one
  pass per tree level, for all rows; counted at the head's forward);
- greedy EAGLE rows of different prompt lengths and draft lengths, in one batch, equal their
  request decoded plainly alone, exactly (fp32), and drafted trees that were accepted;
- an EAGLE row whose sampling raises in a drafting step fails alone: the step is rerun (the
  rows' catch-up already done) and the other rows still equal plain decoding;
- the batched trees equal the trees each row drafts alone, up to rounding: same roots, and the
  same tokens where the batch's rounding does not flip a ranking (checked on most rows).
"""

from pathlib import Path

import pytest
import torch
from helpers import PATTERN, PROMPTS

import specdecode.core.sampling
from specdecode import SamplingParams, SpecDecoder
from specdecode.drafters.eagle import EagleDrafter, propose_together
from specdecode.engine.batch import BatchEngine
from specdecode.models.heads import load_heads

BROKEN_TEMPERATURE = 0.77  # the injected failure below hits rows sampling at this temperature
ROWS = [(PATTERN[:60], 3, 30), (PATTERN[7:80], 2, 12), (PATTERN[3:150], 4, 24), (PROMPTS[0], 3, 20)]


@pytest.fixture(scope="module")
def dec(tiny_qwen2_dir: Path, eagle_dir: Path) -> SpecDecoder:
    decoder = SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", dtype="fp32", device="cpu",
                                          show_progress=False)
    decoder.attach_heads(load_heads(eagle_dir, torch.float32, torch.device("cpu")))
    return decoder


def engine(dec: SpecDecoder, **kwargs) -> BatchEngine:
    # Not cost-aware: every drafting row drafts its own k each step.
    options = {"max_batch": 4, "kv_cache_tokens": 1024, "block_size": 4, "cost_aware": False} | kwargs
    return dec.batch_engine(**options)


def plain(dec: SpecDecoder, rows) -> list[list[int]]:
    return [dec.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True), method="none").token_ids
            for p, _, n in rows]


def head_passes_of_a_drafting_step(dec: SpecDecoder, monkeypatch: pytest.MonkeyPatch, prompts: list[str]) -> int:
    """Head forward calls in the second step of EAGLE rows of ``prompts`` (k = 3): a drafting
    step whose head passes read no prompt (the first step's catch-up reads the prompts' pairs)."""
    eng = engine(dec)
    for prompt in prompts:
        eng.add_request(dec.encode(prompt), SamplingParams(max_new_tokens=20, ignore_eos=True), "eagle", 3)
    eng.step()
    head = eng.heads["eagle"].head
    calls = []
    real = head.forward

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])  # the rows of the pass
        return real(*args, **kwargs)

    monkeypatch.setattr(head, "forward", counted)
    outputs = eng.step()
    monkeypatch.undo()
    assert len(outputs) == len(prompts) and all(o.stats.tree_nodes_proposed > 0 for o in outputs), "every row drafted"
    return len(calls)


def test_a_step_of_three_eagle_rows_runs_one_rows_head_passes(dec: SpecDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    alone = head_passes_of_a_drafting_step(dec, monkeypatch, [PATTERN[:60]])
    together = head_passes_of_a_drafting_step(dec, monkeypatch, [PATTERN[:60], PATTERN[7:80], PATTERN[3:150]])
    assert alone > 1  # a catch-up and at least one tree level
    assert together == alone


def test_eagle_rows_of_different_lengths_equal_plain_decoding(dec: SpecDecoder) -> None:
    eng = engine(dec)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, _, n in ROWS]
    ids = [eng.add_request(dec.encode(p), ps, "eagle", k) for (p, k, _), ps in zip(ROWS, params, strict=True)]
    stats = {i: None for i in ids}
    generated: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for output in eng.step():
            assert output.error is None
            generated.setdefault(output.request_id, []).extend(output.new_tokens)
            stats[output.request_id] = output.stats
    assert [generated[i] for i in ids] == plain(dec, ROWS)
    assert sum(s.tree_nodes_proposed for s in stats.values()) > sum(s.draft_tokens_proposed for s in stats.values()) > 0
    assert sum(s.draft_tokens_accepted for s in stats.values()) > 0


def test_a_failing_eagle_row_fails_alone(dec: SpecDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    real_probs = specdecode.core.sampling.LogitsProcessor.probs
    calls = []

    def probs(self, logits):
        if self.temperature == BROKEN_TEMPERATURE:
            calls.append(1)
            if len(calls) > 1:  # its first (plain) step passes; it fails once it drafts
                raise RuntimeError("injected sampling failure")
        return real_probs(self, logits)

    monkeypatch.setattr(specdecode.core.sampling.LogitsProcessor, "probs", probs)
    eng = engine(dec, max_batch=5)
    ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=n, ignore_eos=True), "eagle", k)
           for p, k, n in ROWS]
    bad = eng.add_request(dec.encode(PATTERN[5:90]), SamplingParams(temperature=BROKEN_TEMPERATURE, max_new_tokens=20),
                          "eagle", 3)
    generated: dict[str, list[int]] = {}
    errors = {}
    while eng.has_unfinished:
        for output in eng.step():
            generated.setdefault(output.request_id, []).extend(output.new_tokens)
            if output.error is not None:
                errors[output.request_id] = output.error
    assert set(errors) == {bad} and "injected" in str(errors[bad])
    assert [generated[i] for i in ids] == plain(dec, ROWS)


def eagle_rows(dec: SpecDecoder) -> list[tuple[EagleDrafter, torch.Tensor, int]]:
    """A fresh drafter per row of ``ROWS``, shown the target's features of its prompt."""
    prototype = dec.drafters["eagle"]
    assert isinstance(prototype, EagleDrafter)
    rows = []
    for prompt, k, _ in ROWS:
        ids = dec.encode(prompt)
        drafter = prototype.fresh()
        drafter.start(len(ids), len(ids) + 8)
        committed = torch.tensor(ids, dtype=torch.long)
        hidden = dec.target.model(committed[None], torch.arange(len(ids))[None], compute_logits=False).hidden
        drafter.observe(hidden, 0)  # (1, L, C)
        rows.append((drafter, committed, k))
    return rows


@torch.inference_mode()
def test_batched_trees_are_each_rows_own_trees(dec: SpecDecoder) -> None:
    """Drafting rows together (a padded catch-up, then one pass per level) changes a tree only
    through rounding: in fp32 here, on no row at all but for a near tie."""
    alone = [propose_together([row])[0] for row in eagle_rows(dec)]
    together = propose_together(eagle_rows(dec))
    assert all(a.size > 1 for a in alone)
    assert all(t.tokens[0] == a.tokens[0] for t, a in zip(together, alone, strict=True))
    same = sum(t.parents == a.parents and torch.equal(t.tokens, a.tokens) for t, a in zip(together, alone, strict=True))
    assert same >= len(ROWS) - 1

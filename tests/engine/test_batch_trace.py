"""Pass traces on the batch engine holding one request (engine/batch_trace.py), the default
engine of ``generate``: tracing changes no token, the trace's passes and rows are the ones the
engine's stats count, a chat's next turn begins after its cached prefix, an engine rebuilt inside
the block is traced too, and the trace replays on random weights of the same shapes. fp32 tiny
models on the CPU."""

from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, decoder, llamacpp_decoder, traced_generate

from specdecode import SamplingParams
from specdecode.backends.torch_backend import TorchSequence
from specdecode.bench.oracle import max_trace_rows
from specdecode.bench.replay import full_model_config, random_model, replay
from specdecode.engine.batch_trace import TracingBatchModel, TracingPagedBatchModel
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.trace import BEGIN, DRAFT, EXTEND, TARGET, TREE, PassEvent, PassTrace, TracingSequence

TRACING = (TracingBatchModel, TracingPagedBatchModel)


def verify_passes(trace: PassTrace) -> list[PassEvent]:
    """The target's passes that computed logits: one per decode step."""
    return [e for e in trace.passes(TARGET) if e.op == TREE or e.args[2] > 0]


def verify_rows(event: PassEvent) -> int:
    return event.rows if event.op == TREE else event.args[2]


def assert_counts_match(trace: PassTrace, stats: GenerationStats) -> None:
    """The trace's passes are the ones the stats count, and its verify rows the tokens verified:
    each step's last committed token plus its drafts (a chain's tokens, a tree's nodes)."""
    assert len(list(trace.passes(TARGET))) == stats.target_forward_passes
    assert len(verify_passes(trace)) == stats.verify_steps
    drafted = stats.tree_nodes_proposed or stats.draft_tokens_proposed  # a tree step counts its depth apart
    assert sum(verify_rows(e) for e in verify_passes(trace)) == stats.verify_steps + drafted
    assert len(list(trace.passes(DRAFT))) == stats.draft_forward_passes


def replayed(trace: PassTrace, dec) -> PassTrace:
    """The events a replay of ``trace`` on random models of ``dec``'s shapes issues."""
    again = PassTrace()
    sequences = {}
    for role, loaded in ((TARGET, dec.target), (DRAFT, dec.draft)):
        if loaded is not None:
            model = random_model(full_model_config(loaded), torch.device("cpu"), torch.float32, seed=1)
            sequences[role] = TracingSequence(TorchSequence(model), role, again)
    result = replay(trace, sequences)
    assert result.passes.get(TARGET, 0) == len(list(trace.passes(TARGET))) and result.seconds > 0
    return again


@pytest.mark.parametrize(("method", "k"), [("none", None), ("draft", 3), ("ngram", 4), ("suffix", 4)])
def test_a_traced_request_is_the_untraced_one_and_its_stats(
    tiny_qwen2_dir: Path, tiny_close_draft_dir: Path, method: str, k: int | None
) -> None:
    """Greedy tokens equal untraced; on torch the prompt but its last token is prefilled in a pass
    without logits, then every step is one verify pass (suffix's a token tree); the models are the
    engine's own again after the block; a replay issues the traced calls exactly."""
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir)
    params = SamplingParams(max_new_tokens=20)
    ids = dec.encode(PROMPTS[0] + " " + PROMPTS[0])  # repeated text: lookups find matches
    untraced, traced, trace = traced_generate(dec, ids, params, method, k)
    assert traced.token_ids == untraced
    engine = dec.one_request.engine
    assert not isinstance(engine.target, TRACING) and not isinstance(engine.drafter.model, TRACING)
    stats = traced.stats
    assert_counts_match(trace, stats)
    assert trace.events[0] == PassEvent(TARGET, BEGIN, (trace.events[0].args[0], 0))
    prefill = [e for e in trace.passes(TARGET) if e.op == EXTEND and e.args[2] == 0]
    assert [e.args for e in prefill] == [(0, len(ids) - 1, 0)]
    assert trace.events[0].args[0] >= len(ids) + len(traced.token_ids) - 1  # the capacity holds what it wrote
    if method == "suffix":
        assert any(e.op == TREE for e in trace.events)
    if method == "draft":  # the draft model reads the prompt in a read-ahead pass, without logits
        first_draft = next(trace.passes(DRAFT))
        assert first_draft.args[0] == 0 and first_draft.args[2] == 0
    assert replayed(trace, dec).events == trace.events


def test_a_chats_next_turn_begins_after_its_cached_prefix(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    """Two turns in one block: the second's BEGINs keep the positions the pools' prefix caches
    served (its stats' cached tokens, on the target), its first passes start there, and the
    two turns replay in one run."""
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir)
    params = SamplingParams(max_new_tokens=12)
    first_ids = dec.encode(PROMPTS[1])
    dec.forget_prefix()
    with dec.trace_passes() as trace:
        first = dec.generate(first_ids, params, method="draft", k=3)
        mark = len(trace.events)
        second_ids = first_ids + first.token_ids + dec.encode(" " + PROMPTS[2])
        second = dec.generate(second_ids, params, method="draft", k=3)
    dec.forget_prefix()
    turn = PassTrace(trace.events[mark:])
    assert_counts_match(turn, second.stats)
    begins = {e.role: e for e in turn.events if e.op == BEGIN}
    cached = second.stats.cached_tokens
    assert cached > 0 and begins[TARGET].args[1] == cached
    assert next(turn.passes(TARGET)).args[0] == cached
    if DRAFT in begins:
        assert next(turn.passes(DRAFT)).args[0] == begins[DRAFT].args[1] > 0
    assert replayed(trace, dec).events == trace.events


def test_an_engine_rebuilt_inside_the_block_is_traced(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    """A fixed k past the engine's k_max makes the one-seat engine rebuild itself: the new one is
    traced through its factory, and neither keeps a tracing model after the block."""
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir)
    ids = dec.encode(PROMPTS[2])
    params = SamplingParams(max_new_tokens=24)  # room for a step of k drafts past the first token
    dec.generate(ids, params, method="draft", k=2)
    kept = dec.one_request.engine
    deep = kept.k_max + 2
    with dec.trace_passes() as trace:
        out = dec.generate(ids, params, method="draft", k=deep, k_policy="fixed")
    rebuilt = dec.one_request.engine
    assert rebuilt is not kept and rebuilt.k_max >= deep
    assert_counts_match(trace, out.stats)
    assert max(verify_rows(e) for e in verify_passes(trace)) == deep + 1
    for engine in (kept, rebuilt):
        assert not isinstance(engine.target, TRACING) and not isinstance(engine.drafter.model, TRACING)
    dec.forget_prefix()


def test_llamacpp_merges_the_prompt_into_its_first_verify_pass(tiny_ggufs: dict[str, Path]) -> None:
    """On llama.cpp's batch model the prompt's tail rides in the first verify pass: an EXTEND
    from 0 over the prompt and the step's drafts with logits for the verify rows only (no
    prefill pass), priced by those rows; tokens equal untraced; the trace replays on torch."""
    pytest.importorskip("llama_cpp")
    dec = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["close"])
    ids = dec.encode(PROMPTS[0])
    params = SamplingParams(max_new_tokens=12)
    dec.forget_prefix()
    untraced = dec.generate(ids, params, method="draft", k=3).token_ids
    dec.forget_prefix()
    with dec.trace_passes() as trace:
        traced = dec.generate(ids, params, method="draft", k=3)
    dec.forget_prefix()
    assert traced.token_ids == untraced
    assert_counts_match(trace, traced.stats)
    start, rows, logit_rows = next(trace.passes(TARGET)).args
    assert (start, rows - logit_rows) == (0, len(ids) - 1) and logit_rows >= 1
    assert not any(e.op == EXTEND and e.args[2] == 0 for e in trace.passes(TARGET))
    assert max_trace_rows([trace]) <= 4  # the prompt's tail is no verify row
    assert replayed(trace, dec).events == trace.events

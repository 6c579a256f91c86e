"""Pass traces and their replay (engine/trace.py, bench/replay.py): tracing changes nothing, and a
replay on random weights of the same shapes makes exactly the traced passes, counted call by call.
fp32 tiny models on the CPU."""

from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, decoder, traced_generate

from specdecode import SamplingParams
from specdecode.backends.torch_backend import TorchSequence
from specdecode.bench.replay import model_config_dict, model_config_from_dict, random_model, replay
from specdecode.engine.trace import DRAFT, EXTEND, TARGET, TREE, PassTrace, TracingSequence, load_traces, save_traces

METHODS = (("none", None), ("draft", 3), ("ngram", 4), ("suffix", 4), ("auto", "auto"), ("draft", "auto"))


@pytest.mark.parametrize(("method", "k"), METHODS)
def test_a_replay_makes_the_traced_passes_exactly(
    tiny_qwen2_dir: Path, tiny_close_draft_dir: Path, tmp_path: Path, method: str, k: int | str | None
) -> None:
    """Tracing leaves the output as it was; the trace holds every pass (prefill, verify, draft
    catch-ups, tree passes on torch for suffix); a replay through sequences of random models with
    the same shapes issues the same calls (the replayed trace equals the recorded one), and
    survives a save and load."""
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir)
    params = SamplingParams(max_new_tokens=24)
    traces = []
    for prompt in PROMPTS[:2]:
        ids = dec.encode(prompt + " " + prompt)  # repeated text: lookups find matches
        untraced, traced, trace = traced_generate(dec, ids, params, method, k)
        assert traced.token_ids == untraced
        assert dec.engine.target.__class__ is not TracingSequence  # put back after the block
        stats = traced.stats
        verify = [e for e in trace.passes(TARGET) if (e.op == EXTEND and e.args[2] > 0) or e.op == TREE]
        assert len(verify) == stats.verify_steps
        assert sum(e.op == EXTEND and e.args[2] == 0 for e in trace.passes(TARGET)) == stats.target_forward_passes - stats.verify_steps
        assert len(list(trace.passes(DRAFT))) == stats.draft_forward_passes
        if method == "suffix":
            assert any(e.op == TREE for e in trace.events)
        traces.append(trace)

    header = {"target": model_config_dict(dec.target.config), "draft": model_config_dict(dec.draft.config)}
    save_traces(traces, tmp_path / "traces.json", header)
    loaded_header, loaded = load_traces(tmp_path / "traces.json")
    assert [t.events for t in loaded] == [t.events for t in traces]

    models = {role: random_model(model_config_from_dict(loaded_header[role]), torch.device("cpu"), torch.float32, seed=1)
              for role in (TARGET, DRAFT)}
    for trace in loaded:
        again = PassTrace()
        sequences = {role: TracingSequence(TorchSequence(model), role, again) for role, model in models.items()}
        result = replay(trace, sequences)
        assert again.events == trace.events
        assert result.passes.get(TARGET, 0) == len(list(trace.passes(TARGET)))
        assert result.passes.get(DRAFT, 0) == len(list(trace.passes(DRAFT)))
        assert result.seconds > 0


def test_random_model_has_the_shapes_and_finite_logits(tiny_qwen2_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, None, method="none")
    config = model_config_from_dict(model_config_dict(dec.target.config))
    assert config == dec.target.config
    model = random_model(config, torch.device("cpu"), torch.bfloat16)
    sequence = TorchSequence(model)
    sequence.begin(8)
    logits = sequence.extend(torch.zeros((1, 4), dtype=torch.long), 0).logits
    assert logits.shape == (1, 4, config.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0  # random weights, not zeros


def test_a_trace_without_its_models_sequence_is_refused(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir)
    with dec.trace_passes() as trace:
        dec.generate(dec.encode(PROMPTS[0]), SamplingParams(max_new_tokens=4), method="draft", k=2)
    dec.forget_prefix()
    model = random_model(dec.target.config, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="draft"):
        replay(trace, {TARGET: TorchSequence(model)})

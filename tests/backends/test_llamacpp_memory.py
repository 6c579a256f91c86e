"""Memory on llama.cpp: llama.cpp writes a context's whole KV cache when it creates it, so what a
context may hold is what it costs. A model's single-request context holds no more positions
than the model was trained for, and a batch engine of many slots costs the KV of the tokens it
was given (``kv_cache_tokens``), not slots x the model's context."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

import tiny_models

from specdecode import SamplingParams, SpecDecoder
from specdecode.core.device import resident_bytes
from specdecode.engine.grammar_process import release_freed_memory

MIB = 1 << 20
TRAINED_CONTEXT = 4096  # the model's context: what slots x context would give each slot
LAYERS, KV_HEADS, HEAD_DIM = 8, 4, 64  # 8 KiB of f16 K and V per position: the KV dwarfs the rest
KV_BYTES_PER_POSITION = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
SLOTS = 32
KV_CACHE_TOKENS = SLOTS * 256  # 256 positions a slot: the least the batch engine allows
SPARE_SLOTS = 2  # SchedulerConfig's default: slots of the same size beside max_batch
# Compute buffers, logit rows and Python objects for 32 short requests, with room to spare.
OVERHEAD_BYTES = 48 * MIB


@pytest.fixture(scope="module")
def wide_kv_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tiny_models.make_tiny_hf_model(tmp_path_factory.mktemp("wide_kv"), num_layers=LAYERS, num_heads=KV_HEADS,
                                            num_kv_heads=KV_HEADS, max_position_embeddings=TRAINED_CONTEXT)
    path = folder / "model.gguf"
    tiny_models.write_gguf_from_hf(folder, path, "F32")
    return path


def test_many_slots_cost_the_kv_of_their_tokens_not_slots_times_context(wide_kv_gguf: Path) -> None:
    dec = SpecDecoder.from_pretrained(str(wide_kv_gguf), str(wide_kv_gguf), method="draft", backend="llama.cpp",
                                      device="cpu", show_progress=False)
    # The single-request contexts hold the trained context, not the backend's larger default.
    assert dec.target.model.n_ctx == dec.draft.model.n_ctx == TRAINED_CONTEXT == dec.target.config.max_position_embeddings
    prompt = dec.encode("def fibonacci(n):")
    dec.generate(prompt, SamplingParams(max_new_tokens=4))  # the single engine's buffers, touched before measuring
    before = resident_bytes()
    assert before is not None
    engine = dec.batch_engine(max_batch=SLOTS, kv_cache_tokens=KV_CACHE_TOKENS, cost_aware=False)
    for index in range(SLOTS):  # every slot busy at once
        engine.add_request(dec.encode(f"def function_{index}(x):"), SamplingParams(max_new_tokens=4), "draft", 2)
    outputs = engine.run()
    assert len(outputs) == SLOTS and all(outputs.values())
    grown = resident_bytes() - before
    # Two contexts (target and draft), each of (SLOTS + SPARE_SLOTS) sequences of 256 positions.
    kv_bytes = 2 * KV_CACHE_TOKENS * (SLOTS + SPARE_SLOTS) // SLOTS * KV_BYTES_PER_POSITION
    assert grown <= kv_bytes + OVERHEAD_BYTES, f"{grown / MIB:.0f} MiB for {kv_bytes / MIB:.0f} MiB of KV"
    assert grown >= 0.8 * kv_bytes  # the measurement sees the KV at all
    every_slot_whole = 2 * SLOTS * TRAINED_CONTEXT * KV_BYTES_PER_POSITION  # 2 GiB
    assert grown < every_slot_whole / 10


def test_the_single_request_context_costs_nothing_until_a_request_decodes_in_it(wide_kv_gguf: Path) -> None:
    """A decoder's single-request contexts (4,096 positions x 8 KiB = 32 MiB each here; 224 MiB
    for the demo target) are made at the first request that decodes in them, not at load, nor
    by the load-time spot check of stored costs (its own scratch context): a server, which
    decodes in its batch engine's contexts, never pays for them."""
    dec = SpecDecoder.from_pretrained(str(wide_kv_gguf), str(wide_kv_gguf), method="draft", backend="llama.cpp",
                                      device="cpu", show_progress=False, engine="single")
    target, draft = dec.target.model, dec.draft.model
    assert target._ctx is None and draft._ctx is None  # noqa: SLF001 - what is allocated is the point
    # An earlier test's decoder (its batch engine's contexts) freed now, and the freed heap handed
    # back, so that neither its freeing nor the reuse of its resident pages hides this growth.
    gc.collect()
    release_freed_memory()
    before = resident_bytes()
    result = dec.generate(dec.encode("def fibonacci(n):"), SamplingParams(max_new_tokens=4))
    grown = resident_bytes() - before
    assert result.token_ids and target._ctx is not None and draft._ctx is not None  # noqa: SLF001
    contexts = 2 * TRAINED_CONTEXT * KV_BYTES_PER_POSITION  # llama.cpp writes a context's KV as it makes it
    assert grown >= 0.8 * contexts, f"{grown / MIB:.0f} MiB at the first request: the KV was there before"

"""Many prompts through a batch engine to the end: ``SpecDecoder.generate_batch``'s loop.

Each sample is a request of the engine; its tokens go through its own ``IncrementalDecoder``,
whose stop strings end it (the engine is told to abort it, and its stop reason says so). The
samples of one prompt after the first start from the first one's prompt K/V (``fork_of``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdecode.config import SamplingParams
from specdecode.engine.batch import BatchEngine
from specdecode.engine.grammar import CompiledGrammar
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.stream import GenerationResult
from specdecode.engine.text import IncrementalDecoder


def run_samples(
    engine: BatchEngine,
    tokenizer: Any,
    samples: Sequence[tuple[list[int], SamplingParams, CompiledGrammar | None]],
    n: int,
    method: str,
    k: int | None,
    suffix_group: str | None,
    cache_salt: str | None,
    k_policy: str | None = None,
    acceptance: str = "lossless",
) -> list[GenerationResult]:
    """Decode every (prompt ids, params, grammar) sample, ``n`` consecutive samples per prompt,
    with ``method``, draft length (cap) ``k``, ``k_policy`` (None: the engine's) and acceptance
    rule; the results in the samples' order."""
    decoders = [IncrementalDecoder(tokenizer, params.stop) for _, params, _ in samples]
    stats = [GenerationStats() for _ in samples]
    ids_to_index: dict[str, int] = {}
    first_of_prompt: str | None = None  # a prompt's later samples start from its first one's K/V
    for index, ((ids, params, grammar), sample_stats) in enumerate(zip(samples, stats, strict=True)):
        request_id = engine.add_request(ids, params, method, k, stats=sample_stats, suffix_group=suffix_group,
                                        cache_salt=cache_salt, grammar=grammar, k_policy=k_policy,
                                        acceptance=acceptance, fork_of=None if index % n == 0 else first_of_prompt)
        if index % n == 0:
            first_of_prompt = request_id
        ids_to_index[request_id] = index
    while engine.has_unfinished:
        for output in engine.step():
            index = ids_to_index[output.request_id]
            decoders[index].add(output.new_tokens)
            if decoders[index].stopped and not output.finished:
                engine.abort(output.request_id)
                stats[index].stop_reason, stats[index].stop_string = "stop_string", decoders[index].stop_string
    for decoder in decoders:
        decoder.flush()
    return [GenerationResult(d.text, list(d.token_ids), s) for d, s in zip(decoders, stats, strict=True)]

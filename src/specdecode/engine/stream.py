"""What a generation returns: the result, and the stream of text deltas that leads to it.

Both engines yield committed token chunks; ``GenerationStream`` turns them into text as tokens
are accepted (stop strings applied by ``engine.text.IncrementalDecoder``) and finishes the
engine's timing when the caller stops early.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from specdecode.engine.logprobs import TokenLogprob
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.text import IncrementalDecoder


@dataclass(slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens only (an end-of-generation token included, as HF does)
    stats: GenerationStats

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """Each new token's log-probability and the most likely ones there (``SamplingParams.logprobs``
        set; engine/logprobs.py), or None."""
        recorded = self.stats.token_logprobs
        return None if recorded is None else recorded[: len(self.token_ids)]

    def to_dict(self) -> dict[str, Any]:
        data = {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            data["logprobs"] = [entry.to_dict() for entry in self.logprobs]
        return data


class GenerationStream:
    """Iterates over text deltas as tokens are accepted; ``.result`` is set when it ends."""

    def __init__(self, token_chunks: Iterator[list[int]], decoder: IncrementalDecoder, stats: GenerationStats) -> None:
        self._chunks = token_chunks
        self._decoder = decoder
        self.stats = stats
        self.result: GenerationResult | None = None

    @property
    def token_count(self) -> int:
        """New tokens taken so far (their text may be held back while a stop string could follow)."""
        return len(self._decoder.token_ids)

    def __iter__(self) -> Iterator[str]:
        try:
            for chunk in self._chunks:
                delta = self._decoder.add(chunk)
                if delta:
                    yield delta
                if self._decoder.stopped:
                    self.stats.stop_reason = "stop_string"
                    break
            tail = self._decoder.flush()
            if tail:
                yield tail
        finally:
            self._chunks.close()  # finishes the engine's timing even when stopped early
            self.result = GenerationResult(self._decoder.text, list(self._decoder.token_ids), self.stats)

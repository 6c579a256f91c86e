"""What a generation returns: the result, and the stream of text deltas that leads to it.

Both engines yield committed token chunks; ``GenerationStream`` turns them into text as tokens
are accepted (stop strings applied by ``engine.text.IncrementalDecoder``) and finishes the
engine's timing when the caller stops early.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from specdecode.core.logprobs import TokenLogprob
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.text import IncrementalDecoder


class StepTokens(list[int]):
    """The tokens one step committed, as both engines yield them: the first
    ``drafted`` are accepted draft tokens, the rest (at most one) the target's own. Engines that
    yield plain lists count as nothing drafted."""

    def __init__(self, tokens: list[int], drafted: int) -> None:
        super().__init__(tokens)
        self.drafted = drafted


@dataclass(slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens only (an end-of-generation token included, as HF does)
    stats: GenerationStats

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """Each new token's log-probability and the most likely ones there (``SamplingParams.logprobs``
        set; core/logprobs.py), or None."""
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
        pieces = self._pieces(split=False)
        try:
            for text, _ in pieces:
                yield text
        finally:
            pieces.close()  # a caller that stops early ends the engine's generator now, not at collection

    def spans(self) -> Iterator[tuple[str, bool]]:
        """The same text as iterating, in pieces that say whether they came from accepted draft
        tokens (True) or from the target's own tokens (False). A character made of bytes from
        both goes with the token that completes it, and text held back for a stop string goes
        with the token that releases it."""
        return self._pieces(split=True)

    def _pieces(self, split: bool) -> Iterator[tuple[str, bool]]:
        try:
            for chunk in self._chunks:
                drafted = getattr(chunk, "drafted", 0) if split else 0
                # Split, the accepted drafts' text is read apart from the target's token after them.
                for part, from_draft in ((chunk[:drafted], True), (chunk[drafted:], False)):
                    if not part or self._decoder.stopped:
                        continue
                    delta = self._decoder.add(part)
                    if delta:
                        yield delta, from_draft
                if self._decoder.stopped:
                    break
            tail = self._decoder.flush()
            if tail:
                yield tail, False
        finally:
            self._chunks.close()  # finishes the engine's timing even when stopped early
            if self._decoder.stopped:
                # Set after the close: until then a batch worker's steps (and its abort) may still
                # write the request's stop reason.
                self.stats.stop_reason, self.stats.stop_string = "stop_string", self._decoder.stop_string
            self.result = GenerationResult(self._decoder.text, list(self._decoder.token_ids), self.stats)

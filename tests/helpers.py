"""Small helpers shared by the engine, API and CLI tests."""

from functools import lru_cache
from pathlib import Path

from specdecode import SpecDecoder


@lru_cache(maxsize=None)
def decoder(target: Path, draft: Path | None, method: str = "draft", draft_confidence: float = 0.0) -> SpecDecoder:
    """A fp32 CPU decoder over tiny model folders, built once per argument set.

    The confidence cut-off is off by default so that every step drafts exactly k tokens
    (random tiny models are rarely confident).
    """
    return SpecDecoder.from_pretrained(
        str(target),
        str(draft) if draft else None,
        method=method,
        draft_confidence=draft_confidence,
        dtype="fp32",
        device="cpu",
        show_progress=False,
    )

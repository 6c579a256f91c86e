"""Small helpers shared by the engine, API and CLI tests."""

from functools import lru_cache
from pathlib import Path

from specdecode import SpecDecoder


@lru_cache(maxsize=None)
def decoder(target: Path, draft: Path | None, method: str = "draft") -> SpecDecoder:
    """A fp32 CPU decoder over tiny model folders, built once per (target, draft, method)."""
    return SpecDecoder.from_pretrained(
        str(target), str(draft) if draft else None, method=method, dtype="fp32", device="cpu", show_progress=False
    )

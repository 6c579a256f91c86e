"""Where specdecode keeps files it derives (converted GGUF weights, assembled demo models)."""

import os
from pathlib import Path

CACHE_ENV_VAR = "SPECDECODE_CACHE"


def cache_dir() -> Path:
    """The cache root: ``$SPECDECODE_CACHE`` if set, else ``~/.cache/specdecode``."""
    override = os.environ.get(CACHE_ENV_VAR)
    root = Path(override).expanduser() if override else Path.home() / ".cache" / "specdecode"
    root.mkdir(parents=True, exist_ok=True)
    return root

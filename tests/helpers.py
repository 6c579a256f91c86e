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


# A strongly repeating text: a head that learns anything predicts it well.
PATTERN = "def add(a, b):\n    return a + b\n\n" * 100


def pattern_features(target_dir: Path, work_dir: Path) -> tuple[Path, list[Path]]:
    """The tiny target's features over ``PATTERN`` (2,000 tokens in 64-token rows), on disk."""
    import torch

    from specdecode.features import FeatureSpec, extract, read_shards
    from specdecode.models.loader import load_model

    data = work_dir / "pattern.txt"
    data.write_text(PATTERN)
    loaded = load_model(str(target_dir), torch.float32, torch.device("cpu"), show_progress=False)
    tokenizer = loaded.tokenizer
    spec = FeatureSpec(target="tiny", sources=(str(data),), seq_len=64, max_tokens=2_000, top_k=4)
    out = extract(loaded.model, lambda t: list(tokenizer(t, add_special_tokens=False)["input_ids"]), spec,
                  work_dir / "features", show_progress=False)
    return target_dir, read_shards(out)


def train_pattern_heads(kind: str, features: tuple[Path, list[Path]], out: Path, epochs: int) -> dict:
    """Train 3 Medusa heads or an EAGLE head on ``pattern_features`` (CPU, fp32); the report."""
    import torch

    from specdecode.models.loader import load_model
    from specdecode.train_heads import TrainConfig, train_heads

    target_dir, shards = features
    loaded = load_model(str(target_dir), torch.float32, torch.device("cpu"), show_progress=False)
    cfg = TrainConfig(kind=kind, epochs=epochs, lr=3e-3, num_heads=3, eval_fraction=0.2, tree_size=6)
    return train_heads(loaded.model, loaded.model.lm_head.weight, shards, cfg, out, show_progress=False)

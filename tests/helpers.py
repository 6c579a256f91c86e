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


# Greedy equality across passes of different shapes. A verify pass scores k + 1 rows where plain
# decoding scores one; kernels whose rounding depends on the row count (torch's CPU attention
# with a multi-row mask, the native int8 kernel's per-block int16 rounding of activations) move
# logits by up to ~4e-4 on an AMD Zen 4 (issue 19's trace). Where the top two logits are closer
# than that, the two runs may each pick a different token, and neither is wrong. NEAR_TIE is
# an order of magnitude above the largest difference measured, so a gap above it is never a tie.
NEAR_TIE = 5e-3


def greedy_margins(model, prompt_ids: list[int], continuation: list[int], kv_dtype: str = "auto") -> list[float]:
    """The top-1 minus top-2 logit gap of ``model`` at each position of ``continuation``
    (teacher-forced: one pass over prompt + continuation, through a cache of ``kv_dtype``)."""
    import torch

    from specdecode.cache import reusable_cache

    ids = list(prompt_ids) + list(continuation)
    cache = reusable_cache(None, model.config, len(ids), model.dtype, model.device, kv_dtype)
    with torch.inference_mode():
        logits = model.extend(cache, torch.tensor([ids], device=model.device), 0).logits[0]  # (T, V)
    top2 = logits[len(prompt_ids) - 1 : len(ids) - 1].float().topk(2, dim=-1).values  # (len(continuation), 2)
    return (top2[:, 0] - top2[:, 1]).tolist()


def assert_greedy_equal_up_to_near_tie(actual: list[int], expected: list[int], margins: list[float], context: str) -> int:
    """Assert ``actual`` equals ``expected`` (plain greedy decoding) token for token, except that
    from a position whose top-2 gap is below ``NEAR_TIE`` on they may differ. Returns the number
    of positions compared before such a tie (all of them when the outputs are equal), so a test
    can assert that it kept its power."""
    for position, (got, want) in enumerate(zip(actual, expected)):
        if got != want:
            assert margins[position] < NEAR_TIE, (
                f"{context}: differs from plain decoding at token {position} ({got} != {want}) where the top-2 "
                f"logit gap is {margins[position]:.2e} >= {NEAR_TIE}: not a near-tie, a bug"
            )
            return position
    assert len(actual) == len(expected), f"{context}: {len(actual)} tokens != {len(expected)}"
    return len(expected)

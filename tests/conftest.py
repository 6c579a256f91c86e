"""Shared fixtures: tiny models built once per test session (see ``tiny_models.py``)."""

import sys
from pathlib import Path

import pytest

# Import the package from this checkout even when it is not pip-installed; tests/ itself is on
# sys.path already (pytest's rootdir conftest import), which makes ``import tiny_models`` work.
SRC_DIR = Path(__file__).resolve().parents[1] / "src"
if str(SRC_DIR) not in sys.path:
    sys.path.insert(0, str(SRC_DIR))

import tiny_models  # noqa: E402 - after the sys.path line above, which it needs


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with only the tiny tokenizer (tokenizer.json + tokenizer_config.json)."""
    return tiny_models.make_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen2ForCausalLM (fp32, untied, seed 0) with the tiny tokenizer."""
    return tiny_models.make_tiny_hf_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_deep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 6-layer Qwen2ForCausalLM (fp32, seed 1): deep enough to skip layers of."""
    return tiny_models.make_tiny_hf_model(tmp_path_factory.mktemp("tiny_deep"), arch="qwen2", seed=1, num_layers=6)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer LlamaForCausalLM (fp32, untied, seed 0) with the tiny tokenizer."""
    return tiny_models.make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An unrelated random 1-layer Qwen2 draft (seed 1) sharing the tiny tokenizer: rarely agrees."""
    return tiny_models.make_tiny_hf_model(
        tmp_path_factory.mktemp("tiny_draft"), arch="qwen2", seed=1, num_layers=1, hidden_size=128
    )


def _noisy_copy(source: Path, out: Path, relative_noise: float) -> Path:
    """``source`` with Gaussian noise (``relative_noise`` x each tensor's std) on every weight."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            param.add_(relative_noise * param.std() * torch.randn(param.shape, generator=generator))
    model.save_pretrained(out, safe_serialization=True)
    tiny_models.make_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_close_draft_dir(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 target plus 2% weight noise: a draft that agrees often (~60% greedy), not always."""
    return _noisy_copy(tiny_qwen2_dir, tmp_path_factory.mktemp("tiny_close_draft"), 0.02)


@pytest.fixture(scope="session")
def tiny_far_draft_dir(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 target plus 10% weight noise: q differs from p enough that the residual matters."""
    return _noisy_copy(tiny_qwen2_dir, tmp_path_factory.mktemp("tiny_far_draft"), 0.10)


@pytest.fixture(scope="session")
def pattern_features(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """The tiny Qwen2 target's feature shards over a strongly repeating text (see helpers)."""
    from helpers import pattern_features as extract_pattern_features

    return extract_pattern_features(tiny_qwen2_dir, tmp_path_factory.mktemp("pattern"))


@pytest.fixture(scope="session")
def medusa_dir(pattern_features, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 Medusa heads trained 12 epochs on the repeating text (held-apart top-1 ~0.75)."""
    from helpers import train_pattern_heads

    out = tmp_path_factory.mktemp("medusa")
    train_pattern_heads("medusa", pattern_features, out, epochs=12)
    return out


@pytest.fixture(scope="session")
def eagle_dir(pattern_features, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An EAGLE head trained 12 epochs on the repeating text (held-apart depth-1 top-1 ~0.85)."""
    from helpers import train_pattern_heads

    out = tmp_path_factory.mktemp("eagle")
    train_pattern_heads("eagle", pattern_features, out, epochs=12)
    return out


@pytest.fixture(scope="session")
def tiny_ggufs(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path, tiny_far_draft_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """F32 GGUF files of the tiny target, the close draft (2% weight noise) and the far one (10%)."""
    out = tmp_path_factory.mktemp("tiny_ggufs")
    paths = {}
    for name, folder in (("target", tiny_qwen2_dir), ("close", tiny_close_draft_dir), ("far", tiny_far_draft_dir)):
        paths[name] = out / f"{name}.gguf"
        tiny_models.write_gguf_from_hf(folder, paths[name], "F32")
    return paths

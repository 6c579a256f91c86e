"""Shared fixtures: tiny models built once per test session (see ``tiny_models.py``)."""

import sys
from pathlib import Path

import pytest

# Import the package from this checkout even when it is not pip-installed; tests/ itself is on
# sys.path already (pytest's rootdir conftest import), which makes ``import tiny_models`` work.
SRC_DIR = Path(__file__).resolve().parents[1] / "src"
if str(SRC_DIR) not in sys.path:
    sys.path.insert(0, str(SRC_DIR))

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with only the tiny tokenizer (tokenizer.json + tokenizer_config.json)."""
    return tiny_models.make_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen2ForCausalLM (fp32, untied, seed 0) with the tiny tokenizer."""
    return tiny_models.make_tiny_hf_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer LlamaForCausalLM (fp32, untied, seed 0) with the tiny tokenizer."""
    return tiny_models.make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0)

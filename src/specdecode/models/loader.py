"""Load a model and its tokenizer from a name: demo model, GGUF file, local folder or hub id.

Every source ends up as a Hugging Face-format folder (``config.json`` + safetensors +
tokenizer files): GGUF files are converted once into the cache by ``gguf_loader``, and hub
ids are downloaded by ``huggingface_hub``. One weight loader then serves all of them.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specdecode.config import ModelConfig
from specdecode.errors import ModelLoadError
from specdecode.models.llama import Transformer, component_names

# Files a model folder needs; hub downloads fetch only these (no .bin / .pth duplicates).
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


@dataclass(slots=True)
class LoadedModel:
    name: str
    folder: Path  # the tokenizer (and, on the torch backend, config and weights)
    model: Any  # models.llama.Transformer on the torch backend, backends.llamacpp.LlamaCppModel on llama.cpp
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    config: ModelConfig
    quant: str = "none"  # weight quantization applied at load: none, int8, int4
    backend: str = "torch"  # where its passes run: "torch" or "llama.cpp"


def gguf_source(name: str, show_progress: bool = True) -> Path | None:
    """The GGUF file a model argument names (demo model, .gguf file, folder of one), else None."""
    from specdecode.models import demo

    if demo.is_demo_model_name(name):
        return demo.demo_model_path(name, show_progress=show_progress)
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def resolve_model_folder(name: str, dtype: torch.dtype, show_progress: bool = True) -> Path:
    """Map a model argument to a local Hugging Face-format folder, converting or downloading."""
    from specdecode.models import gguf_loader

    gguf_path = gguf_source(name, show_progress=show_progress)
    if gguf_path is not None:
        return gguf_loader.cached_hf_folder_for_gguf(gguf_path, dtype, show_progress=show_progress)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(
                f"{path} has no config.json: a model folder needs config.json and *.safetensors "
                "(or pass a .gguf file)."
            )
        return path
    if name.endswith(".gguf") or os.sep in name and not _looks_like_hub_id(name):
        raise ModelLoadError(f"Model file {name!r} does not exist.")
    if not _looks_like_hub_id(name):
        raise ModelLoadError(
            f"{name!r} is neither a local file or folder, a demo model name, nor a Hugging Face "
            "hub id (owner/name)."
        )
    return _download_from_hub(name)


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as err:  # network errors, missing repos, gated repos: all user-facing
        raise ModelLoadError(
            f"Could not download {repo_id!r} from the Hugging Face hub ({type(err).__name__}: {err}). "
            "Check the id and your network, or pass a local folder or .gguf file."
        ) from err


def read_model_config(folder: Path) -> ModelConfig:
    config_path = folder / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"Cannot read {config_path}: {err}") from err
    # Multimodal or nested configs keep the decoder under text_config.
    if "text_config" in raw and "model_type" not in raw.get("text_config", {}):
        raw = raw["text_config"]
    try:
        return ModelConfig.from_hf_dict(raw)
    except KeyError as err:
        raise ModelLoadError(f"{config_path} lacks the field {err.args[0]!r}.") from err


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"No *.safetensors weights in {folder}.")
    return files


def load_weights(
    folder: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    pack: bool = True,
    quant: str = "none",
    gguf_path: Path | None = None,
    show_progress: bool = False,
) -> Transformer:
    """Build the transformer on the meta device and fill it from safetensors, checking every name.

    ``quant`` (none, int8, int4) replaces the projections by weight-only quantized ones; int4
    takes Q4_K blocks from ``gguf_path`` exactly where it can (see ``models.quantize``). ``pack``
    prepacks the remaining bf16 projections for the CPU's matmul kernels where that is faster.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {name for name, _ in model.named_parameters()}
    # Our parameter -> the checkpoint tensors (names without "model.") it is made of.
    sources = {name: component_names(name) or (name,) for name in expected}
    wanted = {part for parts in sources.values() for part in parts}
    loaded: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    name = key.removeprefix("model.")
                    if name in wanted:
                        loaded[name] = handle.get_tensor(key).to(device=device, dtype=dtype)
        except Exception as err:
            raise ModelLoadError(f"Cannot read weights from {file}: {err}") from err
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in loaded
    if tied:
        loaded.pop("lm_head.weight", None)
        del sources["lm_head.weight"]
    missing = sorted(part for parts in sources.values() for part in parts if part not in loaded)
    if missing:
        raise ModelLoadError(f"{folder} is missing weights: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    try:
        state = {
            name: loaded[parts[0]] if len(parts) == 1 else torch.cat([loaded.pop(p) for p in parts], dim=0)
            for name, parts in sources.items()
        }
    except RuntimeError as err:  # q/k/v or gate/up with disagreeing input sizes
        raise ModelLoadError(f"Weights in {folder} do not fit together: {err}") from err
    for name, tensor in state.items():
        expected_shape = model.get_parameter(name).shape
        if tensor.shape != expected_shape:
            raise ModelLoadError(
                f"Weight {name} in {folder} has shape {tuple(tensor.shape)}, config.json implies {tuple(expected_shape)}."
            )
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    # Buffers (RoPE frequencies) were built on meta; rebuild them for real.
    model.inv_freq = _real_inv_freq(cfg, device)
    model = model.eval().requires_grad_(False)
    if quant != "none":
        from specdecode.models.quantize import quantize_model

        summary = quantize_model(model, quant, gguf_path=gguf_path)
        if show_progress:
            print(f"specdecode: quantized {summary.describe()}", file=sys.stderr, flush=True)
    if pack:
        model.pack_weights_for_cpu()
    return model


def _real_inv_freq(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    from specdecode.models.llama import rope_inverse_frequencies

    return rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)


def load_tokenizer(folder: Path) -> object:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:
        raise ModelLoadError(f"Cannot load the tokenizer in {folder}: {err}") from err


def load_model(
    name: str, dtype: torch.dtype, device: torch.device, show_progress: bool = True, quant: str = "none"
) -> LoadedModel:
    folder = resolve_model_folder(name, dtype, show_progress=show_progress)
    if show_progress:
        weights = "" if quant == "none" else f", {quant} weights"
        print(f"specdecode: loading {name} ({str(dtype).removeprefix('torch.')}{weights}, {device})", file=sys.stderr, flush=True)
    cfg = read_model_config(folder)
    gguf_path = gguf_source(name, show_progress=False) if quant == "int4" else None
    model = load_weights(folder, cfg, dtype, device, quant=quant, gguf_path=gguf_path, show_progress=show_progress)
    tokenizer = load_tokenizer(folder)
    return LoadedModel(name=name, folder=folder, model=model, tokenizer=tokenizer, config=cfg, quant=quant)
